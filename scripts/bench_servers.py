"""Online benchmark of OpenAI-compatible servers on this machine, one after the other, with
the same client and prompts: `python -m engine.bench serve` at several concurrencies.

    python scripts/bench_servers.py --out bench-results/             # xlaserve only
    python scripts/bench_servers.py --llama-cpp-python /venv/bin/python --out bench-results/

Each server is started, waited for, benchmarked at every concurrency and stopped before
the next one starts, so they never share the CPU. Prompts are random text of common
words (one token each) so servers without token-id prompts get the same input; every
request asks for exactly --output-len tokens (ignore_eos / min_tokens). The machine's
matmul and copy ceilings are measured before and after, and kept with the results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.bench import measure_ceilings
from models.default_model import SERVED_NAME, fetch_default_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(cmd: list[str], url: str, ready_path: str, log: Path, timeout: float = 900):
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + ready_path, timeout=2).status_code == 200:
                    break
            if time.monotonic() > end:
                raise RuntimeError(f"{cmd[:3]} not ready after {timeout}s; see {log}")
            time.sleep(1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench(url: str, label: str, concurrency: int, args, out: Path) -> dict:
    path = out / f"{label}-c{concurrency}.json"
    cmd = [sys.executable, "-m", "engine.bench", "serve", "--base-url", url, "--model",
           SERVED_NAME, "--num-prompts", str(args.num_prompts), "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
           "--text-prompts", "--max-concurrency", str(concurrency), "--no-ceilings",
           # new prompts at each level, so no run is served from an earlier run's prefix cache
           "--seed", str(concurrency),
           "--label", f"{label} c={concurrency}", "--output", str(path)]
    subprocess.run(cmd)  # failed requests are counted in the results, not fatal
    return json.loads(path.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--llama-cpp-python", metavar="PYTHON",
                   help="a Python with llama-cpp-python[server] installed: benchmark its server "
                        "on the same GGUF file too")
    p.add_argument("--xlaserve-args", default="", help="extra flags for python -m server")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = str(fetch_default_model())
    ceilings = measure_ceilings("float32", 64, 576, 1536)
    results = []

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ctx = args.input_len + args.output_len + 64  # room for prompts a token or two longer
    ours = [sys.executable, "-m", "server", "--port", str(port), "--max-model-len", str(ctx),
            "--max-num-seqs", "64", *args.xlaserve_args.split()]
    with running(ours, url, "/health", args.out / "xlaserve.log"):
        results += [bench(url, "xlaserve", c, args, args.out) for c in args.concurrency]

    if args.llama_cpp_python:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        theirs = [args.llama_cpp_python, "-m", "llama_cpp.server", "--model", gguf,
                  "--model_alias", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                  "--n_ctx", str(ctx), "--n_threads", "2", "--n_threads_batch", "2",
                  # queue concurrent requests instead of cutting off the stream in progress
                  "--interrupt_requests", "False"]
        with running(theirs, url, "/v1/models", args.out / "llama-cpp-python.log"):
            results += [bench(url, "llama-cpp-python", c, args, args.out)
                        for c in args.concurrency]

    again = measure_ceilings("float32", 64, 576, 1536)
    for key in ("matmul_flops_per_s", "copy_bytes_per_s"):
        ceilings[key] = max(ceilings[key], again[key])
    summary = {"ceilings": ceilings, "runs": [
        {k: r[k] for k in ("label", "completed", "failed", "duration_s", "output_throughput",
                           "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                           "median_itl_ms", "median_e2el_ms", "total_input_tokens",
                           "total_output_tokens", "host", "cpu_count")} for r in results]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nceilings: matmul {ceilings['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s (float32 "
          f"64x576x1536), copy {ceilings['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    print("| server | concurrency | output tok/s | median TTFT ms | median TPOT ms | failed |")
    print("|---|---|---|---|---|---|")
    for r in summary["runs"]:
        name, c = r["label"].rsplit(" c=", 1)
        print(f"| {name} | {c} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | "
              f"{r['median_tpot_ms']:.1f} | {r['failed']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
