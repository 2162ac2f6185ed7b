"""The steps of scripts/gpu_check.py, each a subprocess with its own time limit and log in the
output directory: engine benches on random weights, the server on random weights and on a real
model, parity; all bounded by the kit's deadline (`set_deadline`)."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENGINE_FIELDS = ("ready_s", "warmup_s", "num_executables", "num_blocks", "matmul_flops_per_s",
                 "copy_bytes_per_s", "read_bytes_per_s", "dense_t1_ms", "median_ttft_ms",
                 "median_tpot_ms", "output_throughput", "ceiling_fraction",
                 "compilations_after_warmup", "weight_copies", "spec_acceptance_rate",
                 "spec_mean_accepted_length", "profile")
# Weight bytes a decode reads per weight, by --quantization (scales and norms: ~0.1-3% more).
WEIGHT_ITEMSIZE = {"int8": 1, "int4": 0.5}


_DEADLINE = [float("inf")]  # perf_counter time by which every step must be done (--deadline-s)
MIN_STEP_SECONDS = 10  # a step left less time than this is skipped


def _limit(timeout: float) -> float:
    return max(0.0, min(timeout, _DEADLINE[0] - time.perf_counter()))


def set_deadline(seconds: float) -> None:
    """Every step ends within `seconds` from now (--deadline-s)."""
    _DEADLINE[0] = time.perf_counter() + seconds


def run_step(name: str, cmd: list[str], out: Path, timeout: float, env=None) -> dict:
    """Run one step; its output goes to DIR/name.log."""
    log = out / f"{name}.log"
    start = time.perf_counter()
    timeout = _limit(timeout)
    if timeout < MIN_STEP_SECONDS:
        print(f"=== {name}: skipped, the deadline is near", flush=True)
        return {"name": name, "cmd": cmd, "rc": "no time left", "ok": False, "seconds": 0.0}
    print(f"=== {name}: {' '.join(cmd)}", flush=True)
    # A step past its time limit gets SIGABRT first: with PYTHONFAULTHANDLER its every
    # thread's stack goes to its log, so a step that hangs says where.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
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


def engine_bench(name, preset, dtype, batch, out, timeout, smoke, quantization=None,
                 extra=(), env=None) -> dict:
    """`python -m engine.bench` on random weights of `preset` (more arguments in `extra`,
    more environment in `env`); at batch 1 its decode's floor: the bytes a step reads over
    the same run's read bandwidth."""
    n_in, n_out = (16, 8) if smoke else (128, 128)
    cmd = [sys.executable, "-m", "engine.bench", "--random-weights", "--config", preset,
           "--dtype", dtype, "--input-len", str(n_in), "--output-len", str(n_out),
           "--ignore-eos", "--output", str(out / f"{name}.json")]
    if quantization:
        cmd += ["--quantization", quantization]
    cmd += list(extra)
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
    step = run_step(name, cmd, out, timeout, env)
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


def server_step(name: str, out: Path, model: str, server_args: list[str], timeout: float,
                check, env: dict[str, str] | None = None) -> dict:
    """Step `name`: `python -m server --model MODEL SERVER_ARGS` (`env` added to its
    environment) on a free port (its log in DIR/name.log) and, once it answers /health,
    `check(url, step, left)`, which fills in `step` and its "ok" (`left()`: the seconds the
    step has left)."""
    from bench_servers import free_port, running

    start = time.perf_counter()
    step = {"name": name, "ok": False, "log": f"{name}.log"}
    timeout = _limit(timeout)
    if timeout < 10:
        return step | {"rc": "no time left", "seconds": 0.0}
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--model", model, "--port", str(port), *server_args]
    step["cmd"] = cmd
    print(f"=== {name}: {' '.join(cmd)}", flush=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with running(cmd, url, "/health", out / f"{name}.log", timeout, env) as ready:
            step["ready_s"] = ready["ready_after_s"]
            check(url, step, lambda: _limit(timeout - (time.perf_counter() - start)))
    except Exception as e:  # reported, never raised: the report is the product here
        step["error"] = f"{type(e).__name__}: {e}"
    step["seconds"] = time.perf_counter() - start
    answer = f"{step['answer']!r} " if "answer" in step else ""
    print(f"    ok={step['ok']} in {step['seconds']:.0f} s {answer}{step.get('error', '')}",
          flush=True)
    return step


def online(out: Path, preset: str, dtype: str, offline: dict, timeout: float,
           smoke: bool) -> dict:
    """The server on random weights of `preset` (--load-format dummy) with the offline
    batch-64 run's limits and KV pages (so the executables it stored serve here), checked,
    then `engine.bench serve` at concurrency 1 and 64 (4 under --smoke), and a short run at
    the larger concurrency traced between the server's /start_profile and /stop_profile
    (`profile`: where a step's time goes while serving)."""
    args = (offline.get("result") or {}).get("args") or {}
    n_in, n_out = (16, 8) if smoke else (128, 128)
    server_args = ["--load-format", "dummy", "--dtype", dtype]
    limits = {"--max-model-len": args.get("max_model_len"),
              "--max-num-seqs": args.get("max_num_seqs"),
              "--max-num-batched-tokens": args.get("max_num_batched_tokens"),
              "--num-pages": (offline.get("result") or {}).get("num_blocks")}
    for flag, value in limits.items():
        if value is not None:
            server_args += [flag, str(value)]

    def bench(url: str, name: str, c: int, n: int, out_len: int, label: str, left) -> dict:
        path = out / f"{label}.json"
        cmd = [sys.executable, "-m", "engine.bench", "serve", "--base-url", url,
               "--model", name, "--num-prompts", str(n), "--max-concurrency", str(c),
               "--input-len", str(n_in), "--output-len", str(out_len), "--ignore-eos",
               "--no-ceilings", "--output", str(path)]
        if smoke:  # the tiny vocabulary is under the ids the bench draws
            cmd.append("--text-prompts")
        with open(out / f"{label}.log", "w") as log:
            subprocess.run(cmd, cwd=ROOT, check=True, timeout=left(), stdout=log,
                           stderr=subprocess.STDOUT)
        res = json.loads(path.read_text())
        return {k: res.get(k) for k in ("median_tpot_ms", "median_ttft_ms",
                                        "output_throughput", "completed")}

    def check(url: str, step: dict, left) -> None:
        import httpx

        name = _serve_checks(url, step)
        for c, n in ((1, 4 if smoke else 8), (4 if smoke else 64, 16 if smoke else 64)):
            step[f"c{c}"] = bench(url, name, c, n, n_out, f"online_c{c}", left)
        step["ok"] = (step["completion_tokens"] == 8 and step["stream_chunks"] >= 8
                      and step["metrics_ok"])
        # Traced apart, after the figures above: tracing slows the server.
        httpx.post(url + "/start_profile", timeout=left()).raise_for_status()
        c = 4 if smoke else 64
        step["profiled"] = bench(url, name, c, c, 8 if smoke else 32, "online_profiled", left)
        r = httpx.post(url + "/stop_profile", timeout=left())
        r.raise_for_status()
        step["profile"] = r.json()

    model = write_random_hf_model(out / "dummy-model", preset, weights=False)
    try:
        return server_step("online", out, str(model), server_args, timeout, check,
                           env={"XLASERVE_PROFILER_DIR": str(out / "online-trace")})
    finally:
        shutil.rmtree(model, ignore_errors=True)


def parity(out: Path, model: str, reference: str | None, dtype: str, timeout: float,
           name: str = "parity") -> dict:
    """`python -m models.parity` on a real model in `dtype` (teacher-forced top-1 agreement
    with transformers' greedy tokens, from a saved reference where given)."""
    cmd = [sys.executable, "-m", "models.parity", "--model", model, "--prompts",
           "tests/data/parity_prompts.txt", "--max-tokens", "32", "--dtype", dtype,
           "--min-agreement", "0.98"]
    if reference:
        cmd += ["--reference", reference]
    step = run_step(name, cmd, out, timeout)
    for line in (out / f"{name}.log").read_text(errors="replace").splitlines():
        if line.startswith("PARITY "):
            step["result"] = json.loads(line.removeprefix("PARITY "))
    return step


def real_server(out: Path, model: str, dtype: str, timeout: float, smoke: bool) -> dict:
    """`python -m server` serving a real model on the device: a greedy chat answer."""
    server_args = ["--dtype", dtype, "--quantization", "none", "--max-model-len", "512"]
    if smoke:
        server_args += ["--max-num-seqs", "4", "--max-num-batched-tokens", "64"]

    def check(url: str, step: dict, left) -> None:
        import httpx

        name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": name, "temperature": 0, "max_tokens": 32, "messages": [
            {"role": "user", "content": "What is the capital of France?"}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        step["answer"] = r.json()["choices"][0]["message"]["content"]
        step["ok"] = "Paris" in step["answer"]

    return server_step("real_server", out, model, server_args, timeout, check)


def speculative(out: Path, model: str, dtype: str, timeout: float, smoke: bool) -> dict:
    """A real model at one stream on tests/data/grounded_prompts.jsonl (edits and quoted
    summaries of a given text), without and with speculative decoding by prompt lookup, paired
    in one process (`engine.bench --paired`: each request alone on both engines, taking
    turns): the median TPOT ratio, the ratio of the means and the drafts' acceptance; then 20
    of the drafting engine's steps traced (on an H200 a drafting step took ~5.9 ms against a
    plain one's 1.96, though its program is hardly larger: where the rest goes). Up to 8
    sequences, so that the 4 drafts and the token before them fit one step's head rows."""
    path = out / "speculative.json"
    cmd = [sys.executable, "-m", "engine.bench", "--model", model, "--dtype", dtype,
           "--dataset", "tests/data/grounded_prompts.jsonl", "--num-prompts",
           "2" if smoke else "8", "--output-len", "8" if smoke else "128",
           "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
           "--paired", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
           "--profile", str(out / "speculative-trace"), "--output", str(path)]
    step = run_step("speculative", cmd, out, timeout)
    if step["ok"] and path.exists():
        res = json.loads(path.read_text())
        paired = res["paired"]
        step["result"] = {
            "tpot_plain_ms": paired["plain_median_tpot_ms"],
            "tpot_ngram_ms": paired["drafting_median_tpot_ms"],
            "speedup": paired["median_tpot_ratio"], "mean_speedup": paired["mean_tpot_ratio"],
            "requests": paired["requests"],
            "compilations_after_warmup": [res.get("compilations_after_warmup"),
                                          paired["plain_compilations_after_warmup"]],
            **{k: res.get(k) for k in ("spec_acceptance_rate", "spec_mean_accepted_length")},
            "profile": res.get("profile")}
    return step
