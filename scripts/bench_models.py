"""Model-layer numbers for docs/performance.md: load, reload and compile times.

Usage: python scripts/bench_models.py [--model PATH] [--output FILE.json]

Each time sits next to the ceiling measured in the same run: the host copy
bandwidth (numpy, 256 MiB arrays) and the file read rate (page cache warm), and
the lower bound they imply for touching the parameters once.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("XLASERVE_NO_PROGRESS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from models.convert import convert  # noqa: E402
from models.generate import GreedyDecoder  # noqa: E402
from models.known_models import fetch_default_model  # noqa: E402
from models.loader import load_model  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes/s counted as read + write, best of 5."""
    src = np.ones(64 << 20, np.float32)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return 2 * src.nbytes / best


def matmul_rate() -> float:
    """float32 FLOP/s of an XLA matmul at a decoder-like skinny shape (128 x 576 x 1536)."""
    import jax.numpy as jnp

    a, b = jnp.ones((128, 576), jnp.float32), jnp.ones((576, 1536), jnp.float32)
    f = jax.jit(lambda a, b: (a @ b).sum())
    f(a, b).block_until_ready()
    best = min(_timed(lambda: f(a, b).block_until_ready()) for _ in range(50))
    return 2 * 128 * 576 * 1536 / best


def read_rate(path: Path) -> float:
    path.read_bytes()  # warm the page cache
    best = min(_timed(path.read_bytes) for _ in range(3))
    return path.stat().st_size / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def param_bytes(model) -> int:
    from flax import nnx

    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--output")
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    path = Path(args.model or fetch_default_model())

    res = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                      f"jax {jax.__version__} on {jax.devices()[0].platform}",
           "model": path.name}
    res["copy_bandwidth_GBps"] = copy_bandwidth() / 1e9
    res["file_read_GBps"] = read_rate(path) / 1e9
    res["matmul_f32_GFLOPs"] = matmul_rate() / 1e9

    start = time.perf_counter()
    model = load_model(path, dtype="float32")
    res["gguf_load_s"] = time.perf_counter() - start
    nbytes = param_bytes(model)
    res["param_MB_float32"] = nbytes / 1e6
    # Ceiling: writing the float32 params once at copy bandwidth (read+write counted).
    res["param_write_floor_s"] = 2 * nbytes / (res["copy_bandwidth_GBps"] * 1e9)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = convert(path, Path(tmp) / "ckpt", "float32")
        load_model(ckpt, dtype="float32")  # first read warms the page cache
        start = time.perf_counter()
        load_model(ckpt, dtype="float32")
        res["orbax_reload_s"] = time.perf_counter() - start

    decoder = GreedyDecoder(model, max_len=1024)
    cache = decoder.new_cache()
    for n, key in ((128, "compile_prefill128_s"), (1, "compile_decode1_s")):
        start = time.perf_counter()
        _, cache = decoder.run(cache, list(range(10, 10 + n)), 0)
        res[key] = time.perf_counter() - start  # first call: trace + compile + one run
        start = time.perf_counter()
        _, cache = decoder.run(cache, list(range(10, 10 + n)), 0)
        res[key.replace("compile", "run")] = time.perf_counter() - start

    cfg = model.cfg
    per_token = 2 * (nbytes // 4 - cfg.vocab_size * cfg.hidden_size)  # dense FLOPs, no attention
    res["prefill128_dense_GFLOPs"] = 128 * per_token / res["run_prefill128_s"] / 1e9
    res["prefill128_fraction_of_matmul"] = res["prefill128_dense_GFLOPs"] / res["matmul_f32_GFLOPs"]

    for k, v in res.items():
        print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
