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

LANES = 16  # partial sums per row: one vector of float32 on AVX-512


def row_sum(x: jax.Array) -> jax.Array:
    """[..., n] -> [..., 1]: the sum of each row, in the same order for any leading shape.

    The row is cut into LANES-wide pieces added one after another (LANES independent partial
    sums, as a vectorised loop keeps them), then the LANES partials are added as a binary
    tree."""
    *lead, n = x.shape
    pad = -n % LANES
    if pad:  # zeros leave every partial sum as it is
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)])
    pieces = x.reshape(*lead, (n + pad) // LANES, LANES)
    acc = pieces[..., 0, :]
    for j in range(1, pieces.shape[-2]):
        acc = acc + pieces[..., j, :]
    width = LANES
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:]
    return acc


def mean_square(x: jax.Array) -> jax.Array:
    """[..., n] -> [..., 1]: the mean of x * x over each row (RMS norms), as `row_sum` orders
    it."""
    return row_sum(x * x) / x.shape[-1]
