"""python -m engine.bench --task embed: texts and tokens a second of the in-process embedding
engine (engine/embedding_engine.py), beside the machine's matmul ceiling.

    python -m engine.bench --task embed --model all-minilm-l6-v2 --input-len 128 \\
        --num-prompts 256 --concurrency 64

Each request is one input of `--input-len` random token ids; `--concurrency` requests are in
flight at once (1: one text at a time, what a lone client sees). The achieved fraction of
the ceiling counts the dense FLOPs (2 x the layers' parameters per token, attention's
products not counted) over the matmul rate at the model's [rows x hidden x intermediate]
shape, measured before and after the run (the better reading of each).
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import time

import jax
import numpy as np

from engine.bench.ceilings import measure_ceilings
from engine.config import EngineConfig
from engine.embedding_engine import EmbeddingEngine

DEFAULT_MODEL = "all-minilm-l6-v2"


def build(args) -> EmbeddingEngine:
    from models.known_models import model_arg

    cfg = EngineConfig(model=model_arg(args.model or DEFAULT_MODEL), task="embed",
                       dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       cpu_kernels=args.cpu_kernels)
    return EmbeddingEngine(cfg)


async def _send_all(engine: EmbeddingEngine, inputs: list[list[int]], concurrency: int):
    gate = asyncio.Semaphore(concurrency)
    latencies = []

    async def one(ids):
        async with gate:
            start = time.perf_counter()
            await engine.embed([ids])
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(ids) for ids in inputs))
    return latencies, time.perf_counter() - start


def _ceilings(engine: EmbeddingEngine, rows: int) -> dict:
    runner = engine.runner
    hidden = runner.hidden_size
    intermediate = next((leaf.shape[-2] for path, leaf in
                         jax.tree_util.tree_leaves_with_path(runner.params)
                         if "up" in jax.tree_util.keystr(path) and leaf.ndim == 3), 4 * hidden)
    return measure_ceilings(np.float32, rows, hidden, intermediate)


def run_embed(args) -> dict:
    built = time.perf_counter()
    engine = build(args)
    ready_s = time.perf_counter() - built
    try:
        runner = engine.runner
        length = min(args.input_len, engine.max_model_len)
        rng = np.random.default_rng(args.seed)
        # ids above the first thousand: real word pieces, never a special token
        inputs = [list(map(int, rng.integers(1000, engine.vocab_size, length)))
                  for _ in range(args.num_prompts)]
        rows = max(1, min(args.max_num_seqs, args.max_num_batched_tokens // length))
        ceilings = _ceilings(engine, rows * length)
        asyncio.run(_send_all(engine, inputs[:min(8, len(inputs))], args.concurrency or 1))
        latencies, duration = asyncio.run(_send_all(engine, inputs, args.concurrency
                                                    or len(inputs)))
        again = _ceilings(engine, rows * length)
        for key in ("matmul_flops_per_s", "copy_bytes_per_s"):
            ceilings[key] = max(ceilings[key], again[key])
        # the layers' matrices: the stacked [layers, out, in] leaves
        layer_params = sum(x.size for x in jax.tree.leaves(runner.params) if x.ndim == 3)
        tokens = length * len(inputs)
        dense = 2 * layer_params * tokens / duration
        return {"device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
                "host": platform.processor() or platform.machine(), "jax": jax.__version__,
                "task": "embed", "model": engine.config.model, "input_len": length,
                "num_prompts": len(inputs), "concurrency": args.concurrency or len(inputs),
                "ready_s": ready_s, "num_executables": len(runner.buckets),
                "compilations_after_warmup": runner.compilations_after_warmup,
                "texts_per_s": len(inputs) / duration, "tokens_per_s": tokens / duration,
                "mean_latency_ms": 1e3 * statistics.mean(latencies),
                "median_latency_ms": 1e3 * statistics.median(latencies),
                "p99_latency_ms": 1e3 * float(np.percentile(latencies, 99)),
                "duration_s": duration, **ceilings,
                "dense_flops_per_s": dense,
                "matmul_fraction": dense / ceilings["matmul_flops_per_s"]}
    finally:
        engine.shutdown()
