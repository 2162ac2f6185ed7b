"""The benchmarks, apart from the code they measure (docs/benchmarking.md):

    python -m engine.bench ...                 offline: the engine in this process (offline.py;
                                               --task embed: an embedding model, embed.py)
    python -m engine.bench serve ...           online: an OpenAI-compatible server (serve.py;
                                               --task embed: /v1/embeddings, serve_embed.py)
    python -m engine.bench.attention ...       the attention kernels (attention.py)
    python -m engine.bench.quantization ...    the weight formats' products (quantization.py)

`ceilings` measures the machine's matmul rate and read bandwidth beside each run, `simulated`
is the device-less runner of `--simulate-device-ms`, `plot` draws `serve --plot`. Importing
this package imports nothing else (`serve` runs without jax).
"""
