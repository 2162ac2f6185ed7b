"""The GPU bring-up kit: every check a session on a lent accelerator runs, in one call.

    python scripts/gpu_check.py --out DIR           # on the GPU machine (within 10 minutes)
    python scripts/gpu_check.py --smoke --out DIR   # the same steps on CPU, tiny shapes (CI)
    python scripts/gpu_check.py --out DIR --parity-model GGUF --parity-reference REF.json

Steps, each a subprocess with its own time limit and log in DIR (a step that fails or runs out
of time is reported and the next one runs; the most wanted run first, and those the deadline
leaves no time for are reported as skipped):

1. environment: python, jax/jaxlib/flax versions, devices and compute capability, the
   attention backend `auto` picks, nvidia-smi.
2. `python -m engine.bench --random-weights --config llama-3-8b --dtype bfloat16` at batch 1
   (one sequence's limits: a few executables), in bfloat16, `--quantization int8` and
   `int4`: TPOT beside its floor (weight + KV bytes a step over the same run's read
   bandwidth, a sum over a 4 GiB array), ready time from an empty compile cache, and the
   count of whole layer matrices the compiled step copies or converts (0: read in place).
3. the 8B engine at batch 64 (the engine's default limits).
4. online: `python -m server --load-format dummy` on the 8B shape (config.json and a
   word-level tokenizer, random weights) with step 3's limits, so its executables come from
   the store step 3 filled (its ready time is a warm start); a completion, a streamed one
   and /metrics; then `python -m engine.bench serve` at concurrency 1 and 64, beside the
   offline engine's TPOT (step 2) and tokens a second (step 3).
5. with --parity-model: `python -m models.parity` in bfloat16 against a saved transformers
   reference (`--save-reference`, made on a CPU machine), and a greedy chat through
   `python -m server` serving that model on the device.
6. the engine bench for the default model's shape (smollm2-135m) at batch 1: TPOT beside
   its matmuls alone (`dense_t1`).
7. `python -m ops.bench_quantization`: float, int8 and int4 matmuls of the 8B MLP's shape at
   1 and 64 rows, each layer's weights sliced as a scan does and at constant indices, float
   weights as a multiply and a sum too, and whether XLA copied or converted a whole matrix.
8. kernel tests: the attention kernels over float16, bfloat16, fp8 and int8 KV pages, and
   tests/test_pallas_gpu_attention.py, compiled for the GPU (interpret mode and a subset
   under --smoke).
9. `python -m ops.bench_attention`: our kernels against the reference and JAX's bundled
   kernel, with the copy and matmul ceilings of the same run.
10. the default model's shape at batch 64.

Writes DIR/gpu_check.json (everything) and DIR/gpu_check.md (the tables for
docs/performance.md, and each of the GPU checks with its figure and bound). Exits non-zero
when a step failed.
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

ENGINE_FIELDS = ("ready_s", "warmup_s", "num_executables", "num_blocks", "matmul_flops_per_s",
                 "copy_bytes_per_s", "read_bytes_per_s", "dense_t1_ms", "median_ttft_ms",
                 "median_tpot_ms", "output_throughput", "ceiling_fraction",
                 "compilations_after_warmup", "weight_copies")
# Weight bytes a decode reads per weight, by --quantization (scales and norms: ~0.1-3% more).
WEIGHT_ITEMSIZE = {"int8": 1, "int4": 0.5}


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

    return int(itemsize * sum(math.prod(s.shape)
                              for s in param_specs(preset_config(preset)).values()))


def kv_bytes_per_token(preset: str, itemsize: int) -> int:
    from models.presets import preset_config

    cfg = preset_config(preset)
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def engine_bench(name, preset, dtype, batch, out, timeout, smoke, quantization=None) -> dict:
    """`python -m engine.bench` on random weights of `preset`; at batch 1 its decode's floor:
    the bytes a step reads over the same run's read bandwidth."""
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
        if batch == 1 and res.get("median_tpot_ms"):
            # Bytes a decode step must read: every weight once, plus the KV of its context
            # (about the prompt and half the output).
            step_bytes = (weight_bytes(preset, WEIGHT_ITEMSIZE.get(quantization, itemsize))
                          + kv_bytes_per_token(preset, itemsize) * (n_in + n_out // 2))
            rate = res.get("read_bytes_per_s") or res["copy_bytes_per_s"]
            step["result"]["step_bytes"] = step_bytes
            step["result"]["floor_tpot_ms"] = step_bytes / rate * 1e3
            achieved = step_bytes / (res["median_tpot_ms"] / 1e3)
            step["result"]["decode_bytes_per_s"] = achieved
            step["result"]["hbm_fraction"] = achieved / rate
    return step


def write_random_hf_model(path: Path, preset: str, dtype: str = "float32",
                          weights: bool = True) -> Path:
    """A random-weight HF directory of a preset's shape with a word-level tokenizer (no torch,
    no network); without `weights`, config.json and the tokenizer only (for
    `--load-format dummy`)."""
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
    path.mkdir(parents=True, exist_ok=True)
    tensors = ({"model.embed_tokens.weight": w(v, e), "model.norm.weight": np.ones(e, np_dtype)}
               if weights else {})
    for i in range(p["num_hidden_layers"] if weights else 0):
        pre = f"model.layers.{i}."
        tensors |= {pre + "self_attn.q_proj.weight": w(h * d, e),
                    pre + "self_attn.k_proj.weight": w(kv * d, e),
                    pre + "self_attn.v_proj.weight": w(kv * d, e),
                    pre + "self_attn.o_proj.weight": w(e, h * d),
                    pre + "mlp.gate_proj.weight": w(f, e), pre + "mlp.up_proj.weight": w(f, e),
                    pre + "mlp.down_proj.weight": w(e, f),
                    pre + "input_layernorm.weight": np.ones(e, np_dtype),
                    pre + "post_attention_layernorm.weight": np.ones(e, np_dtype)}
    if weights and not p.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = w(v, e)
    if weights:
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


def _serve_checks(url: str, step: dict) -> str:
    """A completion, a streamed one and /metrics against a running server (into `step`);
    returns the served model's name."""
    import httpx

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
    step["metrics_ok"] = "xlaserve" in httpx.get(url + "/metrics", timeout=10).text
    return name


def online(out: Path, preset: str, dtype: str, offline: dict, timeout: float,
           smoke: bool) -> dict:
    """The server on random weights of `preset` (--load-format dummy) with the offline
    batch-64 run's limits and KV pages (so the executables it stored serve here), checked,
    then `engine.bench serve` at concurrency 1 and 64 (4 under --smoke)."""
    from bench_servers import free_port, running

    start = time.perf_counter()
    step = {"name": "online", "ok": False, "log": "online.log"}
    timeout = _limit(timeout)
    if timeout < 10:
        return step | {"rc": "no time left", "seconds": 0.0}
    args = (offline.get("result") or {}).get("args") or {}
    model = write_random_hf_model(out / "dummy-model", preset, weights=False)
    port = free_port()
    n_in, n_out = (16, 8) if smoke else (128, 128)
    cmd = [sys.executable, "-m", "server", "--model", str(model), "--port", str(port),
           "--load-format", "dummy", "--dtype", dtype]
    limits = {"--max-model-len": args.get("max_model_len"),
              "--max-num-seqs": args.get("max_num_seqs"),
              "--max-num-batched-tokens": args.get("max_num_batched_tokens"),
              "--num-pages": (offline.get("result") or {}).get("num_blocks")}
    for flag, value in limits.items():
        if value is not None:
            cmd += [flag, str(value)]
    step["cmd"] = cmd
    print(f"=== online: {' '.join(cmd)}", flush=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with running(cmd, url, "/health", out / "online.log", timeout) as ready:
            step["ready_s"] = ready["ready_after_s"]
            name = _serve_checks(url, step)
            for c, n in ((1, 4 if smoke else 8), (4 if smoke else 64, 16 if smoke else 64)):
                path = out / f"online_c{c}.json"
                bench = [sys.executable, "-m", "engine.bench", "serve", "--base-url", url,
                         "--model", name, "--num-prompts", str(n), "--max-concurrency", str(c),
                         "--input-len", str(n_in), "--output-len", str(n_out), "--ignore-eos",
                         "--no-ceilings", "--output", str(path)]
                if smoke:  # the tiny vocabulary is under the ids the bench draws
                    bench.append("--text-prompts")
                left = _limit(timeout - (time.perf_counter() - start))
                with open(out / f"online_c{c}.log", "w") as log:
                    subprocess.run(bench, cwd=ROOT, check=True, timeout=left, stdout=log,
                                   stderr=subprocess.STDOUT)
                res = json.loads(path.read_text())
                step[f"c{c}"] = {k: res.get(k) for k in ("median_tpot_ms", "median_ttft_ms",
                                                          "output_throughput", "completed")}
            step["ok"] = (step["completion_tokens"] == 8 and step["stream_chunks"] >= 8
                          and step["metrics_ok"])
    except Exception as e:  # reported, never raised: the report is the product here
        step["error"] = f"{type(e).__name__}: {e}"
    step["seconds"] = time.perf_counter() - start
    shutil.rmtree(out / "dummy-model", ignore_errors=True)
    print(f"    ok={step['ok']} in {step['seconds']:.0f} s {step.get('error', '')}", flush=True)
    return step


def parity(out: Path, model: str, reference: str | None, dtype: str, timeout: float) -> dict:
    """`python -m models.parity` on a real model in `dtype` (teacher-forced top-1 agreement
    with transformers' greedy tokens, from a saved reference where given)."""
    cmd = [sys.executable, "-m", "models.parity", "--model", model, "--prompts",
           "tests/data/parity_prompts.txt", "--max-tokens", "32", "--dtype", dtype,
           "--min-agreement", "0.98"]
    if reference:
        cmd += ["--reference", reference]
    step = _run("parity", cmd, out, timeout)
    for line in (out / "parity.log").read_text(errors="replace").splitlines():
        if line.startswith("PARITY "):
            step["result"] = json.loads(line.removeprefix("PARITY "))
    return step


def real_server(out: Path, model: str, dtype: str, timeout: float, smoke: bool) -> dict:
    """`python -m server` serving a real model on the device: a greedy chat answer."""
    import httpx
    from bench_servers import free_port, running

    start = time.perf_counter()
    step = {"name": "real_server", "ok": False, "log": "real_server.log"}
    timeout = _limit(timeout)
    if timeout < 10:
        return step | {"rc": "no time left", "seconds": 0.0}
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--model", model, "--port", str(port),
           "--dtype", dtype, "--quantization", "none", "--max-model-len", "512"]
    if smoke:
        cmd += ["--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
    step["cmd"] = cmd
    print(f"=== real_server: {' '.join(cmd)}", flush=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with running(cmd, url, "/health", out / "real_server.log", timeout) as ready:
            step["ready_s"] = ready["ready_after_s"]
            name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            body = {"model": name, "temperature": 0, "max_tokens": 32, "messages": [
                {"role": "user", "content": "What is the capital of France?"}]}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            r.raise_for_status()
            step["answer"] = r.json()["choices"][0]["message"]["content"]
            step["ok"] = "Paris" in step["answer"]
    except Exception as e:  # reported, never raised: the report is the product here
        step["error"] = f"{type(e).__name__}: {e}"
    step["seconds"] = time.perf_counter() - start
    print(f"    ok={step['ok']} in {step['seconds']:.0f} s {step.get('answer', '')!r} "
          f"{step.get('error', '')}", flush=True)
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
    benches = [s for s in report["steps"] if "result" in s and "median_tpot_ms" in s["result"]]
    if benches:
        lines += ["", "| engine.bench | TPOT ms | floor ms (b=1: bytes / read) | out tok/s | "
                  "TTFT ms | dense_t1 ms | dense/ceiling | read fraction (b=1) | "
                  "matmul TFLOP/s | read GB/s | copy GB/s | weight copies | ready s | "
                  "warmup s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in benches:
            r = s["result"]
            def f(k, scale=1.0, fmt="{:.1f}", r=r):
                return "" if r.get(k) is None else fmt.format(r[k] * scale)

            copies = r.get("weight_copies")
            copies = "" if copies is None else sum(copies.values())
            lines.append(f"| {s['name']} | {f('median_tpot_ms', fmt='{:.2f}')} | "
                         f"{f('floor_tpot_ms', fmt='{:.2f}')} | {f('output_throughput')} | "
                         f"{f('median_ttft_ms')} | {f('dense_t1_ms', fmt='{:.2f}')} | "
                         f"{f('ceiling_fraction', fmt='{:.3f}')} | "
                         f"{f('hbm_fraction', fmt='{:.2f}')} | "
                         f"{f('matmul_flops_per_s', 1e-12, '{:.1f}')} | "
                         f"{f('read_bytes_per_s', 1e-9, '{:.0f}')} | "
                         f"{f('copy_bytes_per_s', 1e-9, '{:.0f}')} | {copies} | "
                         f"{f('ready_s')} | {f('warmup_s')} |")
    net = next((s for s in report["steps"] if s["name"] == "online"), None)
    if net:
        lines += ["", f"Online (`python -m server --load-format dummy`, ready in "
                  f"{net.get('ready_s', float('nan')):.1f} s; `engine.bench serve`):", "",
                  "| concurrency | TPOT ms | TTFT ms | out tok/s | completed |",
                  "|---|---|---|---|---|"]
        for key in sorted(k for k in net if k[0] == "c" and k[1:].isdigit()):
            r = net[key]
            lines.append(f"| {key[1:]} | {r['median_tpot_ms']:.2f} | {r['median_ttft_ms']:.1f} | "
                         f"{r['output_throughput']:.1f} | {r['completed']} |")
    par = next((s for s in report["steps"] if s["name"] == "parity"), None)
    if par and par.get("result"):
        r = par["result"]
        lines += ["", f"Parity ({r.get('dtype')} on {r.get('backend')}): top-1 agreement "
                  f"{r['agreement']:.4f} over {r.get('positions')} positions of "
                  f"{r.get('prompts')} prompts."]
    real = next((s for s in report["steps"] if s["name"] == "real_server"), None)
    if real and real.get("answer") is not None:
        lines += ["", f"Greedy chat through the server (ready in {real['ready_s']:.1f} s): "
                  f"{real['answer']!r}"]
    if report.get("checks"):
        lines += ["", "| check | figure | bound | passed |", "|---|---|---|---|"]
        lines += [f"| {what} | {figure:.4g} | {bound} | {'yes' if ok else 'NO'} |"
                  for what, figure, bound, ok in report["checks"]]
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


def checks(report: dict) -> list[tuple[str, float | None, str, bool | None]]:
    """The GPU checks of the roofline issue: (what, figure, bound, passed), from this run."""
    steps = {s["name"]: s for s in report["steps"]}
    result = lambda name: steps.get(name, {}).get("result") or {}
    big = report["big"]
    bf16, int8, int4 = (result(f"engine_{big}_b1{q}") for q in ("", "_int8", "_int4"))
    b64 = result(f"engine_{big}_b{report['batch']}")
    small = result("engine_smollm2_135m_b1")
    net = steps.get("online", {})
    rows = []

    def check(what, figure, bound, ok):
        rows.append((what, figure, bound, None if figure is None else bool(ok)))

    tpot = bf16.get("median_tpot_ms")
    if tpot and bf16.get("floor_tpot_ms"):
        check("b=1 bf16 TPOT ms", tpot, f"<= 1.15 x floor {bf16['floor_tpot_ms']:.2f}",
              tpot <= 1.15 * bf16["floor_tpot_ms"])
    for name, res, share in (("int8", int8, 0.6), ("int4", int4, 0.4)):
        if tpot and res.get("median_tpot_ms"):
            check(f"b=1 {name} TPOT ms", res["median_tpot_ms"], f"<= {share} x bf16's",
                  res["median_tpot_ms"] <= share * tpot)
    for name, res in (("bf16", bf16), ("int8", int8), ("int4", int4), ("b=64", b64)):
        if res.get("weight_copies") is not None:
            copies = sum(res["weight_copies"].values())
            check(f"{name}: whole weight matrices copied in the step", copies, "== 0",
                  copies == 0)
    if b64.get("output_throughput"):
        check("b=64 output tok/s", b64["output_throughput"], ">= 2.5 x 2,762 (H200)",
              b64["output_throughput"] >= 2.5 * 2762)
    if tpot and (net.get("c1") or {}).get("median_tpot_ms"):
        online_tpot = net["c1"]["median_tpot_ms"]
        check("online c=1 TPOT ms", online_tpot, f"within 10% of offline {tpot:.2f}",
              online_tpot <= 1.1 * tpot)
    c64 = net.get(f"c{4 if report['smoke'] else 64}") or {}
    if b64.get("output_throughput") and c64.get("output_throughput"):
        check("online c=64 output tok/s", c64["output_throughput"],
              f"within 10% of offline {b64['output_throughput']:.0f}",
              c64["output_throughput"] >= 0.9 * b64["output_throughput"])
    if small.get("median_tpot_ms") and small.get("dense_t1_ms"):
        check("135M b=1 TPOT ms", small["median_tpot_ms"],
              f"<= 1.5 x dense_t1 {small['dense_t1_ms']:.2f}",
              small["median_tpot_ms"] <= 1.5 * small["dense_t1_ms"])
    if b64.get("ready_s"):
        check("ready, cold compile cache (b=64 table), s", b64["ready_s"], "<= 60",
              b64["ready_s"] <= 60)
    if net.get("ready_s"):
        check("server ready, warm (from the store), s", net["ready_s"], "<= 15",
              net["ready_s"] <= 15)
    agreement = (steps.get("parity", {}).get("result") or {}).get("agreement")
    if agreement is not None:
        check("parity: top-1 agreement", agreement, ">= 0.98", agreement >= 0.98)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the logs and the report")
    ap.add_argument("--smoke", action="store_true",
                    help="the same steps on CPU with tiny shapes (CI); times mean nothing")
    ap.add_argument("--skip", default="", help="comma-separated step names to leave out")
    ap.add_argument("--deadline-s", type=float, default=560,
                    help="every step ends by then (the device tool stops a call at 600 s); "
                         "steps past it are reported as skipped")
    ap.add_argument("--parity-model", help="a real model (GGUF file or HF directory) for the "
                    "parity and greedy-server steps; without it they are left out")
    ap.add_argument("--parity-reference", help="its transformers reference, saved with "
                    "`python -m models.parity --save-reference` (else transformers runs here)")
    args = ap.parse_args(argv)
    _DEADLINE[0] = time.perf_counter() + args.deadline_s
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # every step runs from the checkout (python -m server, tests/)
    skip = set(filter(None, args.skip.split(",")))
    smoke = args.smoke
    if smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    dtype = "float32" if smoke else "bfloat16"
    big = "tiny" if smoke else "llama-3-8b"
    label = big.replace("-", "_").replace(".", "_")
    batch = 8 if smoke else 64
    report = {"smoke": smoke, "environment": environment(), "steps": [], "big": label,
              "batch": batch}
    steps = report["steps"]
    py = sys.executable

    def wanted(name: str) -> bool:
        return name not in skip

    # Most wanted first (the deadline skips what is left).
    for q, limit in (("", 100), ("int8", 80), ("int4", 80)):
        name = f"engine_{label}_b1" + (f"_{q}" if q else "")
        if wanted(name):
            steps.append(engine_bench(name, big, dtype, 1, out, 240 if smoke else limit, smoke,
                                      q or None))
    offline = {}
    if wanted(f"engine_{label}_b{batch}"):
        offline = engine_bench(f"engine_{label}_b{batch}", big, dtype, batch, out,
                               240 if smoke else 120, smoke)
        steps.append(offline)
        path = out / f"engine_{label}_b{batch}.json"
        if path.exists() and "result" in offline:  # the limits and pages the server takes over
            offline["result"]["args"] = json.loads(path.read_text())["args"]
    if wanted("online"):
        steps.append(online(out, big, dtype, offline, 300 if smoke else 150, smoke))
    if args.parity_model and wanted("parity"):
        steps.append(parity(out, args.parity_model, args.parity_reference, dtype,
                            300 if smoke else 60))
    if args.parity_model and wanted("real_server"):
        steps.append(real_server(out, args.parity_model, dtype, 300 if smoke else 60, smoke))
    if not smoke and wanted("engine_smollm2_135m_b1"):
        steps.append(engine_bench("engine_smollm2_135m_b1", "smollm2-135m", dtype, 1, out, 50,
                                  smoke))

    if wanted("quant_bench"):
        # The layer loops, scanned (XLA:GPU copied each float layer's slice) and unrolled, and
        # the candidate for float weights at one row: a multiply and a sum (as int8's).
        cmd = [py, "-m", "ops.bench_quantization", "--output", str(out / "quant_bench.json"),
               "--layouts", "stacked,unrolled", "--rows", "1,64",
               "--formats", "float,int8,int4,float-reduce"]
        steps.append(_run("quant_bench", cmd + (["--smoke"] if smoke else []), out,
                          120 if smoke else 60))
        path = out / "quant_bench.json"
        if path.exists():
            report["quant_summary"] = json.loads(path.read_text())

    if wanted("kernel_tests"):
        # The KV dtypes first, then the kernel's own tests; each case compiles its own
        # Triton kernel (~3 s).
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
        steps.append(_run("kernel_tests", cmd, out, 300 if smoke else 60, env))

    if wanted("attention_bench"):
        cmd = [py, "-m", "ops.bench_attention", "--output", str(out / "attention_bench.json")]
        cmd += (["--smoke", "--impls", "pallas-gpu,bundled-gpu,reference"] if smoke else
                ["--batches", "1,64,256", "--contexts", "2048,8192", "--repeats", "10"])
        steps.append(_run("attention_bench", cmd, out, 300 if smoke else 70))
        path = out / "attention_bench.json"
        if path.exists():
            rows = json.loads(path.read_text()).get("rows", [])
            report["attention_summary"] = [r for r in rows if r.get("seconds")]

    if not smoke and wanted("engine_smollm2_135m_b64"):
        steps.append(engine_bench("engine_smollm2_135m_b64", "smollm2-135m", dtype, 64, out, 60,
                                  smoke))

    report["checks"] = checks(report)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(s["ok"] for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
