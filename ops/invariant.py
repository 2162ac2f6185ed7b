"""Sums over a row in an order fixed by the row's length alone.

A row's numbers must not depend on what else shares its step (docs/architecture.md,
"Batch-invariant rows"): a seeded request samples the same tokens alone or under load.
XLA picks a reduction's strategy by the whole array's shape: on XLA:CPU, jnp.sum over
576-wide rows gives one result for 1-4 rows and another, differing in the last bit, from
8 rows on. `row_sum` writes the order out as elementwise adds, which XLA neither reorders
nor reassociates, so every row is summed the same way whatever the number of rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LANES = 16  # partial sums per row on CPU: one vector of float32 on AVX-512
# Elsewhere (a GPU): XLA runs the partial sums as one kernel with a thread per lane, each
# adding its pieces one after another, so a 4,096-wide row in 16 lanes was a chain of 256
# dependent loads and adds, 6.2 us a norm on an H200 (2 of a Llama-3-8B layer's 18 kernels:
# ~0.3 ms of a 5.5 ms step; docs/performance-log.md, "The kit on an H200, traced"); 128
# lanes cut the chain to 32.
DEVICE_LANES = 128


def row_sum(x: jax.Array) -> jax.Array:
    """[..., n] -> [..., 1]: the sum of each row, in the same order for any leading shape.

    The row is cut into L-wide pieces added one after another (L independent partial sums,
    as a vectorised loop keeps them), then the L partials are added as a binary tree: L is
    LANES on a CPU, DEVICE_LANES elsewhere (an order fixed by the platform and the row's
    length)."""
    return jax.lax.platform_dependent(x, cpu=lambda x: _row_sum(x, LANES),
                                      default=lambda x: _row_sum(x, DEVICE_LANES, True))


def _row_sum(x: jax.Array, lanes: int, kernel_a_lane: bool = False) -> jax.Array:
    *lead, n = x.shape
    pad = -n % lanes
    if pad:  # zeros leave every partial sum as it is
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)])
    pieces = x.reshape(*lead, (n + pad) // lanes, lanes)
    acc = pieces[..., 0, :]
    for j in range(1, pieces.shape[-2]):
        acc = acc + pieces[..., j, :]
    if kernel_a_lane:  # the tree in the sum's consumer: XLA would fold its first levels into
        acc = jax.lax.optimization_barrier(acc)  # the partial sums, a thread for several lanes
    width = lanes
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:]
    return acc


def mean_square(x: jax.Array) -> jax.Array:
    """[..., n] -> [..., 1]: the mean of x * x over each row (RMS norms), as `row_sum` orders
    it."""
    return row_sum(x * x) / x.shape[-1]
