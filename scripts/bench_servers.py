"""Online benchmark of OpenAI-compatible servers on this machine, one after the other, with
the same client and prompts: `python -m engine.bench serve` at several concurrencies.

    python scripts/bench_servers.py --out bench-results/             # xlaserve only
    python scripts/bench_servers.py --llama-cpp-server "$(scripts/build_llama_cpp.sh | tail -1)"
    python scripts/bench_servers.py --llama-cpp-python /venv/bin/python --out bench-results/
    python scripts/bench_servers.py --cpu-kernels auto,avx2,none ...   # each kernel variant
    python scripts/bench_servers.py --task embed --llama-cpp-server PATH  # /v1/embeddings
    python scripts/bench_servers.py --dataset tests/data/grounded_prompts.jsonl --speculative \
        --llama-cpp-server PATH --concurrency 1 64      # each server with and without drafting

Each server is started, waited for, benchmarked at every concurrency and stopped before
the next one starts, so they never share the CPU. Prompts are random text of common
words (one token each) so servers without token-id prompts get the same input; every
request asks for exactly --output-len tokens (ignore_eos / min_tokens), and the table
counts the requests that came back with another length (with `--natural-length`, each
reply ends where the model ends it, at most --output-len tokens, and the table counts those
cut there). Each server's time from start to
ready and its resident memory once ready are kept too, and so are the machine's matmul
and copy ceilings, measured before and after.

`--dataset FILE` sends conversations from a JSON-lines file to /v1/chat/completions instead
(`engine.bench serve --dataset`), e.g. the edits and quoted summaries of
tests/data/grounded_prompts.jsonl. A rewrite's reply is as long as the text it rewrites, so
`--natural-length --output-len 1024` measures whole replies (greedy: every server and arm
generates the same replies up to near-ties, and the table gives each run's output tokens).
`--speculative` runs each server a second time with
speculative decoding by prompt lookup, named NAME+spec: xlaserve with `--speculative-config
SPEC_JSON` (--xlaserve-spec), llama-server with `--spec-type ngram-simple` (--llama-spec);
with `--draft-model NAME` (a known model sharing the vocabulary of `--model NAME`), by that
model's drafts instead: xlaserve's `{"model": FILE, "num_speculative_tokens": 4}`, llama-server's
`--spec-type draft-simple -md FILE --spec-draft-n-max 4`.

`--task embed` measures /v1/embeddings instead (`python -m engine.bench serve --task embed`):
xlaserve serving all-MiniLM-L6-v2 against `llama-server --embedding --pooling mean` on the
same model, which llama.cpp's own convert_hf_to_gguf.py (from the tree the server was built
from) converts once into the user cache with `--outtype f32`, so both servers compute in
float32 (both L2-normalise the mean-pooled vector, as the model's files say). One text of
--input-len common words per request; texts a second, prompt tokens a second (from each
response's usage) and the latency of a whole request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from bench_servers_report import print_runs, run_summary

from engine.bench.ceilings import measure_ceilings
from models.known_models import (
    SERVED_NAME,
    cache_dir,
    fetch_default_model,
    fetch_model,
    known_model,
)

SERVERS = ("xlaserve", "llama-cpp-server", "llama-cpp-python")
EMBED_MODEL = "all-minilm-l6-v2"  # the known model of --task embed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident memory of one process (not its children), from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no VmRSS for process {pid}")


@contextlib.contextmanager
def running(cmd: list[str], url: str, ready_path: str, log: Path, timeout: float = 900,
            env: dict[str, str] | None = None):
    """Start cmd (with `env` added to the environment), wait for a 200 from url +
    ready_path, yield how long that took and the process's resident memory then; stop it
    on exit."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=None if env is None else {**os.environ, **env})
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + ready_path, timeout=2).status_code == 200:
                    break
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"{cmd[:3]} not ready after {timeout}s; see {log}")
            time.sleep(0.25)
        yield {"ready_after_s": time.monotonic() - start, "rss_mib": rss_mib(proc.pid)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def served_model(args) -> str:
    """The model name both the servers and the client use."""
    if args.task == "embed":
        return known_model(EMBED_MODEL).served_name
    return known_model(args.model).served_name if args.model else SERVED_NAME


def server_command(name: str, args, gguf: str, port: int) -> tuple[list[str], str]:
    """The command line that serves the task's model on port, and its ready path."""
    embed = args.task == "embed"
    # room for prompts a token or two longer ([CLS] and [SEP] for the embedding model); a
    # dataset's conversations: up to 1,024 tokens
    ctx = (1024 if args.dataset else args.input_len) + (0 if embed else args.output_len) + 64
    if name.endswith("+spec"):
        cmd, ready = server_command(name.removesuffix("+spec"), args, gguf, port)
        if name.startswith("xlaserve"):
            return [*cmd, "--speculative-config", args.xlaserve_spec], ready
        return [*cmd, *args.llama_spec.split()], ready
    if name.startswith("xlaserve"):
        # Default flags: what a new user runs (--xlaserve-args adds any; "xlaserve-avx2":
        # --cpu-kernels avx2).
        kernels = ["--cpu-kernels", name.split("-", 1)[1]] if "-" in name else []
        model = ["--model", EMBED_MODEL] if embed else ["--model", args.model] if args.model else []
        return [sys.executable, "-m", "server", *model, "--port", str(port), *kernels,
                *args.xlaserve_args.split()], "/health"
    if name == "llama-cpp-server":
        # -c is shared by the -np slots: each gets c / np, rounded up to a multiple of 256 by
        # llama.cpp, and a request stops short (no context shift) once its slot is full.
        per_slot = -(-ctx // 256) * 256
        total = args.llama_ctx or args.llama_parallel * per_slot
        # --embedding serves /v1/embeddings alone; its default --embd-normalize 2 is the
        # model's own L2 normalisation. Batches stay at the default 512 tokens (-ub; the
        # server caps -b to it for embeddings), as xlaserve's --max-num-batched-tokens.
        task = ["--embedding", "--pooling", "mean"] if embed else []
        return [args.llama_cpp_server, "-m", gguf, "--alias", served_model(args),
                "--host", "127.0.0.1", "--port", str(port), "-t", str(args.llama_threads),
                "-np", str(args.llama_parallel), "-c", str(total), *task,
                *llama_cpp_workarounds(), *args.llama_args.split()], "/health"
    if name == "llama-cpp-python":
        threads = str(args.llama_threads)
        return [args.llama_cpp_python, "-m", "llama_cpp.server", "--model", gguf,
                "--model_alias", served_model(args), "--host", "127.0.0.1", "--port", str(port),
                "--n_ctx", str(ctx), "--n_threads", threads, "--n_threads_batch", threads,
                # queue concurrent requests instead of cutting off the stream in progress
                "--interrupt_requests", "False"], "/v1/models"
    raise ValueError(f"unknown server {name!r}; known: {', '.join(SERVERS)}")


def llama_cpp_workarounds(cpuinfo: str | None = None) -> list[str]:
    """Flags llama-server needs on this machine. On a CPU with AMX (seen: a Sapphire Rapids
    VM, 2026-11-24) the llama.cpp of llama-cpp-python 0.3.36 moves Q4_1 weights into ggml's
    AMX buffers and segfaults in ggml_backend_amx_mul_mat at the first batch;
    `--no-repack` keeps them in the plain CPU buffers (ggml has no other repacked Q4_1
    kernel on x86, so elsewhere the flag would change nothing)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    return ["--no-repack"] if " amx_int8" in cpuinfo else []


def llama_cpp_source(server: str) -> Path:
    """The llama.cpp tree scripts/build_llama_cpp.sh built `server` from: OUT/build-V/bin/
    llama-server lies beside OUT/llama_cpp_python-V/vendor/llama.cpp."""
    build = Path(server).resolve().parents[1]
    version = build.name.removeprefix("build-")
    return build.parent / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def convert_command(source: Path, model_dir: Path, out: Path) -> list[str]:
    return [sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir),
            "--outtype", "f32", "--outfile", str(out)]


def embedding_gguf(model_dir: Path, source: Path) -> Path:
    """The embedding model as a float32 GGUF file, converted once into the user cache by the
    llama.cpp tree's own converter (it needs torch, transformers and numpy)."""
    target = cache_dir() / f"{model_dir.name}.f32.gguf"
    if target.is_file():
        return target
    if not (source / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"no convert_hf_to_gguf.py in {source}: name the llama.cpp tree "
                         "with --llama-cpp-source")
    partial = target.with_name(target.name + ".part")
    subprocess.run(convert_command(source, model_dir, partial), check=True)
    partial.chmod(0o600)  # private, as everything xlaserve keeps in the user cache
    partial.rename(target)  # whole: a later run takes it as it is
    return target


def bench(url: str, label: str, concurrency: int, args, out: Path) -> dict:
    path = out / f"{label}-c{concurrency}.json"
    prompts = (["--dataset", str(args.dataset)] if args.dataset else
               ["--input-len", str(args.input_len), "--text-prompts"])
    length = [] if args.natural_length else ["--ignore-eos"]
    task = (["--task", "embed", "--input-len", str(args.input_len)] if args.task == "embed" else
            ["--output-len", str(args.output_len), *length, *prompts])
    cmd = [sys.executable, "-m", "engine.bench", "serve", "--base-url", url, "--model",
           served_model(args), "--num-prompts", str(args.num_prompts), *task,
           "--max-concurrency", str(concurrency), "--no-ceilings",
           # new prompts at each level, so no run is served from an earlier run's prefix cache
           "--seed", str(concurrency),
           "--label", f"{label} c={concurrency}", "--output", str(path)]
    subprocess.run(cmd)  # failed requests are counted in the results, not fatal
    return json.loads(path.read_text())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=("generate", "embed"), default="generate",
                   help=f"embed: /v1/embeddings of {EMBED_MODEL} (xlaserve and llama-server)")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="requests in flight, one run each (default: 1 8 64; embed: 1 64)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests a run (default: 64; embed: 256, a text being quick)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--natural-length", action="store_true",
                   help="--dataset: replies end where the model ends them, at most --output-len "
                        "tokens (default: exactly --output-len, past the model's end)")
    p.add_argument("--servers", type=lambda s: s.split(","),
                   help=f"comma-separated, from {','.join(SERVERS)} (default: xlaserve and "
                        "each server whose path is given)")
    p.add_argument("--model", default=None,
                   help="a known model's name (scripts/fetch_model.py) instead of the default "
                        "model: its GGUF file for the llama.cpp servers, --model NAME for "
                        "xlaserve (with --xlaserve-args for its flags, e.g. --quantization)")
    p.add_argument("--draft-model", default=None,
                   help="--speculative: a known model drafting for --model (both servers)")
    p.add_argument("--dataset", metavar="FILE", default=None,
                   help="conversations ({'messages': [...]} a line) sent to /v1/chat/completions "
                        "instead of random text (--input-len is then ignored)")
    p.add_argument("--speculative", action="store_true",
                   help="each server also with speculative decoding by prompt lookup (NAME+spec)")
    p.add_argument("--xlaserve-spec", default='{"method":"ngram","num_speculative_tokens":4}',
                   help="xlaserve+spec's --speculative-config")
    p.add_argument("--llama-spec", default="--spec-type ngram-simple",
                   help="llama-cpp-server+spec's extra flags")
    p.add_argument("--xlaserve-args", default="", help="extra flags for python -m server")
    p.add_argument("--cpu-kernels", type=lambda s: s.split(","), default=["auto"],
                   help="comma-separated --cpu-kernels values: one xlaserve server each, "
                        "named xlaserve-VALUE (auto: plain xlaserve)")
    p.add_argument("--llama-cpp-server", metavar="PATH",
                   help="llama.cpp's llama-server binary (scripts/build_llama_cpp.sh): "
                        "benchmark it on the same GGUF file too")
    p.add_argument("--llama-cpp-source", metavar="DIR", type=Path,
                   help="--task embed: the llama.cpp tree whose convert_hf_to_gguf.py makes "
                        "the GGUF file (default: the one --llama-cpp-server was built from)")
    p.add_argument("--llama-cpp-python", metavar="PYTHON",
                   help="a Python with llama-cpp-python[server] installed: benchmark its server "
                        "on the same GGUF file too")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count(),
                   help="CPU threads of the llama.cpp servers")
    p.add_argument("--llama-parallel", type=int, default=64,
                   help="llama-server's parallel slots (-np): requests decoded together")
    p.add_argument("--llama-ctx", type=int, default=None,
                   help="llama-server's total context (-c), shared by the slots (default: "
                        "slots x (input + output + 64), rounded up to 256 per slot)")
    p.add_argument("--llama-args", default="",
                   help="extra flags for llama-server, e.g. '--poll 0' on a machine whose "
                        "cores are busy with other work")
    args = p.parse_args(argv)
    embed = args.task == "embed"
    if args.concurrency is None:
        args.concurrency = [1, 64] if embed else [1, 8, 64]
    if args.num_prompts is None:
        args.num_prompts = 256 if embed else 64
    paths = {"llama-cpp-server": args.llama_cpp_server, "llama-cpp-python": args.llama_cpp_python}
    if args.servers is None:
        args.servers = ["xlaserve", *(name for name, path in paths.items() if path)]
    args.servers = [s for name in args.servers for s in (
        [name if k == "auto" else f"{name}-{k}" for k in args.cpu_kernels]
        if name == "xlaserve" else [name])]
    if args.draft_model:
        if not args.speculative:
            p.error("--draft-model drafts for --speculative runs")
        draft = str(fetch_model(args.draft_model))
        args.xlaserve_spec = json.dumps({"model": draft, "num_speculative_tokens": 4})
        args.llama_spec = f"--spec-type draft-simple -md {draft} --spec-draft-n-max 4"
    if args.natural_length and not args.dataset:
        p.error("--natural-length is for --dataset (random prompts have no end of their own)")
    if args.model and embed:
        p.error("--task embed measures its own model")
    if args.speculative:
        if embed or "llama-cpp-python" in args.servers:
            p.error("--speculative measures xlaserve and llama-cpp-server generating")
        args.servers = [s for name in args.servers for s in (name, f"{name}+spec")]
    for name in args.servers:
        name = name.removesuffix("+spec")
        if name.split("-", 1)[0] == "xlaserve":
            continue
        if name not in SERVERS:
            p.error(f"unknown server {name!r} in --servers; known: {', '.join(SERVERS)}")
        if name in paths and not paths[name]:
            p.error(f"--servers {name} needs --{name} PATH")
        if embed and name == "llama-cpp-python":
            p.error("--task embed measures xlaserve and llama-cpp-server")
    return args


def model_file(args) -> str:
    """What the llama.cpp servers load: the default model's GGUF file, or (embed) the
    embedding model converted; xlaserve names its model itself."""
    if args.task != "embed":
        return str(fetch_model(args.model) if args.model else fetch_default_model())
    model_dir = fetch_model(EMBED_MODEL)
    if "llama-cpp-server" not in args.servers:
        return ""
    source = args.llama_cpp_source or llama_cpp_source(args.llama_cpp_server)
    return str(embedding_gguf(model_dir, source))


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = model_file(args)
    ceilings = measure_ceilings("float32", 64, 576, 1536)
    results, servers = [], {}
    for name in args.servers:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd, ready_path = server_command(name, args, gguf, port)
        with running(cmd, url, ready_path, args.out / f"{name}.log") as started:
            servers[name] = started
            results += [bench(url, name, c, args, args.out) for c in args.concurrency]

    again = measure_ceilings("float32", 64, 576, 1536)
    for key in ("matmul_flops_per_s", "copy_bytes_per_s"):
        ceilings[key] = max(ceilings[key], again[key])
    summary = {"task": args.task, "ceilings": ceilings, "servers": servers,
               "runs": [run_summary(r, args) for r in results]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nceilings: matmul {ceilings['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s (float32 "
          f"64x576x1536), copy {ceilings['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    print("| server | ready after s | RSS when ready MiB |\n|---|---|---|")
    for name, s in servers.items():
        print(f"| {name} | {s['ready_after_s']:.1f} | {s['rss_mib']:.0f} |")
    print_runs(summary["runs"], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
