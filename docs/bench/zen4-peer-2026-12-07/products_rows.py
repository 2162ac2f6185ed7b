"""The default model's gate and up products (30 layers of packed Q4_1, 1,536 x 576 each) through
the CPU kernel at 1, 2, 4 and 8 rows, x in 24 bits (the default) and in 8: one jit of the 30
layers, the median of 30 calls. "cache": every layer reads layer 0 (its 1.1 MB stays in the two
cores' L2); "memory": each layer its own. Run from the repository root:

    python docs/bench/zen4-peer-2026-12-07/products_rows.py
"""

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_native import FORMATS, _stack  # noqa: E402

from ops.quantized_linear import linears, stacked  # noqa: E402

gate = _stack(FORMATS["Q4_1"], 1536, 576, layers=30, seed=1, packed=True)
up = _stack(FORMATS["Q4_1"], 1536, 576, layers=30, seed=2, packed=True)


def run(x, g, u, bits, same):
    def body(layer, acc):
        at = 0 if same else layer
        a, b = linears(x + acc[:, :1] * 0, [stacked(g, at), stacked(u, at)], native=True,
                       lanes=True, x_bits=bits)
        return acc + a[:, :576] + b[:, :576]
    return jax.lax.fori_loop(0, 30, body, jnp.zeros_like(x))


f = jax.jit(run, static_argnums=(3, 4))
rng = np.random.default_rng(0)
weights = 30 * 2 * 1536 * 576
for same in (True, False):
    for bits in (24, 8):
        for rows in (1, 2, 4, 8):
            x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))
            f(x, gate, up, bits, same).block_until_ready()
            times = []
            for _ in range(30):
                start = time.perf_counter()
                f(x, gate, up, bits, same).block_until_ready()
                times.append(time.perf_counter() - start)
            ms = np.median(times) * 1e3
            print(f"{'cache' if same else 'memory'} bits={bits} T={rows}: {ms:.3f} ms, "
                  f"{weights * rows / ms / 1e6:.1f} G weight-row products/s", flush=True)
