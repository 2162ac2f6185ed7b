"""The GPU bring-up kit: every check a first session on a lent accelerator runs, in one call.

    python scripts/gpu_check.py --out DIR           # on the GPU machine (within 10 minutes)
    python scripts/gpu_check.py --smoke --out DIR   # the same steps on CPU, tiny shapes (CI)

Steps, each a subprocess with its own time limit and log in DIR (a step that fails or runs out
of time is reported and the next one runs; the most wanted run first, and those the deadline
leaves no time for are reported as skipped):

1. environment: python, jax/jaxlib/flax versions, devices and compute capability, the
   attention backend `auto` picks, nvidia-smi.
2. `python -m engine.bench --random-weights --config llama-3-8b --dtype bfloat16` at batch 1
   (one sequence's limits: a few executables), with the HBM copy and matmul ceilings; the
   decode is reported as a fraction of the copy bandwidth (weight + KV bytes a step / TPOT)
   and beside its floor. Then the same with `--quantization int8` (issue 14): its TPOT
   beside the bfloat16 one, and its bytes (one a weight) over the copy bandwidth.
3. `python -m ops.bench_quantization`: float, int8 and int4 matmuls of the 8B MLP's shape at
   1 and 64 rows, each layer's weights sliced as the model's scan does, at a loop counter
   and at constant indices, and whether XLA copied or converted a whole matrix.
4. the 8B engine at batch 64 (the engine's default limits).
5. kernel tests: the attention kernels over float16, bfloat16, fp8 and int8 KV pages, and
   tests/test_pallas_gpu_attention.py, compiled for the GPU (interpret mode and a subset
   under --smoke).
6. a server smoke test: a random-weight HF directory of the default model's shape (a
   word-level tokenizer), `python -m server` on it, a completion, a streamed completion and
   /metrics.
7. `python -m ops.bench_attention`: our kernels against the reference and JAX's bundled
   kernel, with the copy and matmul ceilings of the same run.
8. the engine bench for the default model's shape (smollm2-135m) at batch 1 and 64.

Writes DIR/gpu_check.json (everything) and DIR/gpu_check.md (the tables for
docs/performance.md). Exits non-zero when a step failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

ENGINE_FIELDS = ("warmup_s", "num_executables", "matmul_flops_per_s", "copy_bytes_per_s",
                 "dense_t1_ms", "median_ttft_ms", "median_tpot_ms", "output_throughput",
                 "ceiling_fraction", "compilations_after_warmup")


_DEADLINE = [float("inf")]  # perf_counter time by which every step must be done (--deadline-s)


def _limit(timeout: float) -> float:
    return max(0.0, min(timeout, _DEADLINE[0] - time.perf_counter()))


def _run(name: str, cmd: list[str], out: Path, timeout: float, env=None) -> dict:
    """Run one step; its output goes to DIR/name.log."""
    log = out / f"{name}.log"
    start = time.perf_counter()
    timeout = _limit(timeout)
    if timeout < 10:
        print(f"=== {name}: skipped, the deadline is near", flush=True)
        return {"name": name, "cmd": cmd, "rc": "no time left", "ok": False, "seconds": 0.0}
    print(f"=== {name}: {' '.join(cmd)}", flush=True)
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout, env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.perf_counter() - start
    tail = log.read_text(errors="replace").splitlines()[-15:]
    print(f"    rc={rc} in {seconds:.0f} s" + ("" if rc == 0 else "\n    " + "\n    ".join(tail)),
          flush=True)
    return {"name": name, "cmd": cmd, "rc": rc, "ok": rc == 0, "seconds": seconds,
            "log": log.name, "tail": tail}


def environment() -> dict:
    import jax
    import jaxlib

    from ops.attention import resolve_backend

    env = {"python": sys.version.split()[0], "host": platform.node(), "jax": jax.__version__,
           "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
           "auto_attention_backend": resolve_backend("auto"),
           "devices": [{"kind": d.device_kind, "platform": d.platform,
                        "compute_capability": getattr(d, "compute_capability", None)}
                       for d in jax.devices()],
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    try:
        import flax
        env["flax"] = flax.__version__
    except ImportError:
        env["flax"] = None
    if shutil.which("nvidia-smi"):
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,"
             "driver_version", "--format=csv,noheader"], capture_output=True, text=True,
            timeout=30).stdout.strip()
    return env


def weight_bytes(preset: str, itemsize: int) -> int:
    from models.presets import preset_config
    from models.registry import param_specs

    return itemsize * sum(math.prod(s.shape) for s in param_specs(preset_config(preset)).values())


def kv_bytes_per_token(preset: str, itemsize: int) -> int:
    from models.presets import preset_config

    cfg = preset_config(preset)
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def engine_bench(name, preset, dtype, batch, out, timeout, smoke, quantization=None) -> dict:
    n_in, n_out = (16, 8) if smoke else (128, 128)
    cmd = [sys.executable, "-m", "engine.bench", "--random-weights", "--config", preset,
           "--dtype", dtype, "--input-len", str(n_in), "--output-len", str(n_out),
           "--ignore-eos", "--output", str(out / f"{name}.json")]
    if quantization:
        cmd += ["--quantization", quantization]
    if batch == 1:
        cmd += ["--num-prompts", "2" if smoke else "4", "--concurrency", "1"]
        if not smoke:  # one sequence's buckets only: a few executables to compile, not ~27
            cmd += ["--max-num-seqs", "1", "--max-num-batched-tokens", "128"]
    else:
        cmd += ["--num-prompts", str(batch)]
    if smoke:
        # The float steps share batch 8's table (the executable store hands what the batch-1
        # step compiled to the batch-8 one); the int8 step, whose table nothing shares,
        # compiles one sequence's, as on the GPU.
        seqs = "1" if quantization else "8"
        cmd += ["--max-model-len", "64", "--max-num-seqs", seqs, "--max-num-batched-tokens", "16"]
    step = _run(name, cmd, out, timeout)
    path = out / f"{name}.json"
    if step["ok"] and path.exists():
        res = json.loads(path.read_text())
        step["result"] = {k: res.get(k) for k in ENGINE_FIELDS}
        itemsize = 2 if dtype in ("bfloat16", "float16") else 4
        if batch == 1 and res.get("median_tpot_ms") and res.get("copy_bytes_per_s"):
            # Bytes a decode step must read: every weight once (int8: a byte each; the scales
            # and norms are ~0.1% more), plus the KV of its context (about the prompt and half
            # the output).
            step_bytes = (weight_bytes(preset, 1 if quantization == "int8" else itemsize)
                          + kv_bytes_per_token(preset, itemsize) * (n_in + n_out // 2))
            step["result"]["floor_tpot_ms"] = step_bytes / res["copy_bytes_per_s"] * 1e3
            achieved = step_bytes / (res["median_tpot_ms"] / 1e3)
            step["result"]["decode_bytes_per_s"] = achieved
            step["result"]["hbm_fraction"] = achieved / res["copy_bytes_per_s"]
    return step


def write_random_hf_model(path: Path, preset: str, dtype: str = "float32") -> Path:
    """A random-weight HF directory of a preset's shape with a word-level tokenizer (no torch,
    no network): what the server smoke test serves."""
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from models.presets import PRESETS

    p = dict(PRESETS[preset])
    e, f, v = p["hidden_size"], p["intermediate_size"], p["vocab_size"]
    h, kv = p["num_attention_heads"], p["num_key_value_heads"]
    d = e // h
    rng = np.random.default_rng(0)
    np_dtype = np.float16 if dtype == "float16" else np.float32
    w = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.02).astype(np_dtype)
    tensors = {"model.embed_tokens.weight": w(v, e), "model.norm.weight": np.ones(e, np_dtype)}
    for i in range(p["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        tensors |= {pre + "self_attn.q_proj.weight": w(h * d, e),
                    pre + "self_attn.k_proj.weight": w(kv * d, e),
                    pre + "self_attn.v_proj.weight": w(kv * d, e),
                    pre + "self_attn.o_proj.weight": w(e, h * d),
                    pre + "mlp.gate_proj.weight": w(f, e), pre + "mlp.up_proj.weight": w(f, e),
                    pre + "mlp.down_proj.weight": w(e, f),
                    pre + "input_layernorm.weight": np.ones(e, np_dtype),
                    pre + "post_attention_layernorm.weight": np.ones(e, np_dtype)}
    if not p.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = w(v, e)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "rms_norm_eps": 1e-5, "torch_dtype": dtype, "eos_token_id": 1,
              "bos_token_id": 0, **p}
    (path / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(v)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "t0", "eos_token": "t1", "unk_token": "t2",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return path


def server_smoke(out: Path, preset: str, timeout: float, smoke: bool) -> dict:
    import httpx
    from bench_servers import free_port, running

    start = time.perf_counter()
    step = {"name": "server", "ok": False, "log": "server.log"}
    timeout = _limit(timeout)
    if timeout < 10:
        return step | {"rc": "no time left", "seconds": 0.0}
    model = write_random_hf_model(out / "random-model", preset)
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--model", str(model), "--port", str(port)]
    if smoke:
        cmd += ["--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "16"]
    step["cmd"] = cmd
    print(f"=== server: {' '.join(cmd)}", flush=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with running(cmd, url, "/health", out / "server.log", timeout) as ready:
            step["ready_s"] = ready["ready_after_s"]
            name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            body = {"model": name, "prompt": "t5 t6 t7 t8", "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            r.raise_for_status()
            step["completion_tokens"] = r.json()["usage"]["completion_tokens"]
            with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True},
                              timeout=120) as r:
                r.raise_for_status()
                chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
            step["stream_chunks"] = len(chunks)
            metrics = httpx.get(url + "/metrics", timeout=10).text
            step["metrics_ok"] = "xlaserve" in metrics or "vllm" in metrics
            step["ok"] = (step["completion_tokens"] == 8 and len(chunks) >= 8
                          and step["metrics_ok"])
    except Exception as e:  # reported, never raised: the report is the product here
        step["error"] = f"{type(e).__name__}: {e}"
    step["seconds"] = time.perf_counter() - start
    shutil.rmtree(out / "random-model", ignore_errors=True)
    print(f"    ok={step['ok']} in {step['seconds']:.0f} s {step.get('error', '')}", flush=True)
    return step


def markdown(report: dict) -> str:
    env = report["environment"]
    dev = env.get("devices", [{}])[0]
    lines = [f"# GPU check ({'smoke, CPU' if report['smoke'] else dev.get('kind')})", "",
             f"jax {env.get('jax')} (jaxlib {env.get('jaxlib')}), flax {env.get('flax')}, "
             f"python {env.get('python')}; backend {env.get('backend')}, compute capability "
             f"{dev.get('compute_capability')}; `auto` attention: "
             f"{env.get('auto_attention_backend')}.", ""]
    if env.get("nvidia_smi"):
        lines += [f"nvidia-smi: {env['nvidia_smi']}", ""]
    lines += ["| step | ok | seconds |", "|---|---|---|"]
    for s in report["steps"]:
        ok = "yes" if s["ok"] else f"NO ({s.get('rc', s.get('error'))})"
        lines.append(f"| {s['name']} | {ok} | {s.get('seconds', 0):.0f} |")
    benches = [s for s in report["steps"] if "result" in s]
    if benches:
        lines += ["", "| engine.bench | TPOT ms | floor ms (b=1: bytes / copy) | out tok/s | "
                  "TTFT ms | dense/ceiling | HBM fraction (b=1) | matmul TFLOP/s | copy GB/s | "
                  "warmup s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for s in benches:
            r = s["result"]
            def f(k, scale=1.0, fmt="{:.1f}", r=r):
                return "" if r.get(k) is None else fmt.format(r[k] * scale)

            lines.append(f"| {s['name']} | {f('median_tpot_ms')} | "
                         f"{f('floor_tpot_ms', fmt='{:.2f}')} | {f('output_throughput')} | "
                         f"{f('median_ttft_ms')} | {f('ceiling_fraction', fmt='{:.3f}')} | "
                         f"{f('hbm_fraction', fmt='{:.2f}')} | "
                         f"{f('matmul_flops_per_s', 1e-12, '{:.1f}')} | "
                         f"{f('copy_bytes_per_s', 1e-9, '{:.0f}')} | {f('warmup_s')} |")
    quant = report.get("quant_summary")
    if quant:
        lines += ["", f"ops.bench_quantization: [{quant['shape'][0]} -> {quant['shape'][1]}] x "
                  f"{quant['layers']} layers, {quant['dtype']}; copy "
                  f"{quant['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul "
                  f"{quant['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s", "",
                  "| format | layout | rows | ms / layer | weight MiB | copy fraction | "
                  "matmul fraction | rel err | materialized |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['format']} | {r['layout']} | {r['rows']} | {r['seconds'] * 1e3:.4f} | "
                  f"{r['weight_bytes'] / 2**20:.1f} | {r['copy_fraction']:.2f} | "
                  f"{r['matmul_fraction']:.3f} | {r['rel_err']:.1e} | {r['materialized']} |"
                  for r in quant["rows"]]
    attn = report.get("attention_summary")
    if attn:
        lines += ["", "ops.bench_attention (see attention_bench.log for every row):", "",
                  "| case | impl | time | copy fraction | ours x | rel err |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['impl']} | {r['seconds'] * 1e3:.3f} ms | "
                  f"{r.get('copy_fraction', 0):.2f} | {r.get('ours_speedup', 0):.2f} | "
                  f"{r.get('rel_err', 0):.1e} |" for r in attn]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the logs and the report")
    ap.add_argument("--smoke", action="store_true",
                    help="the same steps on CPU with tiny shapes (CI); times mean nothing")
    ap.add_argument("--skip", default="", help="comma-separated step names to leave out")
    ap.add_argument("--deadline-s", type=float, default=560,
                    help="every step ends by then (the device tool stops a call at 600 s); "
                         "steps past it are reported as skipped")
    args = ap.parse_args(argv)
    _DEADLINE[0] = time.perf_counter() + args.deadline_s
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # every step runs from the checkout (python -m server, tests/)
    skip = set(filter(None, args.skip.split(",")))
    smoke = args.smoke
    if smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    report = {"smoke": smoke, "environment": environment(), "steps": []}
    steps = report["steps"]
    py = sys.executable

    # Most wanted first (the deadline skips what is left): the engine on the 8B shape at
    # batch 1, bfloat16 and int8; how quantized matmuls run here; batch 64; the kernel tests;
    # the server; the attention bench; the default model's shape.
    dtype = "float32" if smoke else "bfloat16"
    big = "tiny" if smoke else "llama-3-8b"
    label = big.replace("-", "_").replace(".", "_")
    if f"engine_{label}_b1" not in skip:
        steps.append(engine_bench(f"engine_{label}_b1", big, dtype, 1, out, 240 if smoke else 100,
                                  smoke))
    if f"engine_{label}_b1_int8" not in skip:
        steps.append(engine_bench(f"engine_{label}_b1_int8", big, dtype, 1, out,
                                  240 if smoke else 90, smoke, "int8"))

    if "quant_bench" not in skip:
        # The layer loops beside the model's (scanned: XLA:GPU copied each layer's slice).
        cmd = [py, "-m", "ops.bench_quantization", "--output", str(out / "quant_bench.json"),
               "--layouts", "stacked,counted,unrolled", "--rows", "1,64"]
        steps.append(_run("quant_bench", cmd + (["--smoke"] if smoke else []), out,
                          120 if smoke else 90))
        path = out / "quant_bench.json"
        if path.exists():
            report["quant_summary"] = json.loads(path.read_text())

    if f"engine_{label}_b{8 if smoke else 64}" not in skip:
        steps.append(engine_bench(f"engine_{label}_b{8 if smoke else 64}", big, dtype,
                                  8 if smoke else 64, out, 240 if smoke else 120, smoke))

    if "kernel_tests" not in skip:
        # The KV dtypes first (int8 and fp8 pages have not run on a GPU before), then the
        # kernel's own tests; each case compiles its own Triton kernel (~3 s).
        cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "tests/test_kv_cache_dtype.py::test_attention_reads_pages_in_their_dtype",
               "tests/test_kv_cache_dtype.py::"
               "test_int8_pages_round_trip_through_writes_with_their_scales",
               "tests/test_pallas_gpu_attention.py"]
        env = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "XLASERVE_NATIVE_KERNELS": "0"}
        if smoke:  # the kit's own run of them: the default suite runs every case on CPU
            cmd += ["-k", "pallas-gpu or bad_inputs or lowers_to_triton"]
        else:
            env["JAX_PLATFORMS"] = "cuda,cpu"  # the TPU kernel's interpreter needs the CPU
        steps.append(_run("kernel_tests", cmd, out, 300 if smoke else 90, env))

    if "server" not in skip:
        steps.append(server_smoke(out, "tiny" if smoke else "smollm2-135m",
                                  240 if smoke else 60, smoke))

    if "attention_bench" not in skip:
        cmd = [py, "-m", "ops.bench_attention", "--output", str(out / "attention_bench.json")]
        cmd += (["--smoke", "--impls", "pallas-gpu,bundled-gpu,reference"] if smoke else
                ["--batches", "1,64,256", "--contexts", "2048,8192", "--repeats", "10"])
        steps.append(_run("attention_bench", cmd, out, 300 if smoke else 70))
        path = out / "attention_bench.json"
        if path.exists():
            rows = json.loads(path.read_text()).get("rows", [])
            report["attention_summary"] = [r for r in rows if r.get("seconds")]

    if not smoke:
        for batch, limit in ((1, 60), (64, 60)):
            if f"engine_smollm2_135m_b{batch}" not in skip:
                steps.append(engine_bench(f"engine_smollm2_135m_b{batch}", "smollm2-135m",
                                          dtype, batch, out, limit, smoke))

    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(s["ok"] for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
