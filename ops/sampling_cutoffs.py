"""Per-row cutoffs over the vocabulary without sorting it (ops/sampling.py's filters): the k
best values and their ids (`top_k`), the k-th largest value (`_bisect_top_k`) and the top-p
threshold (`_bisect_top_p`), each exact. A CPU runs XLA's top_k and a 32-pass bisection; a GPU
(and a TPU) reads the k best off the vocabulary's best blocks and searches in 8 unrolled
passes, since there a step's cost is its number of kernels, not its arithmetic, and XLA:GPU
sorts whole rows for a top_k above 16 (docs/performance-log.md, "The kit on an H200,
traced"). Both paths give the same values.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 256  # vocabulary block of the sampler's two-level argmax and draw, and of `top_k`


def _blocks(x: jax.Array, fill: float) -> jax.Array:
    """[S, V] -> [S, V / BLOCK, BLOCK], padding the vocabulary with `fill`."""
    num_blocks = -(-x.shape[1] // BLOCK)
    x = jnp.pad(x, ((0, 0), (0, num_blocks * BLOCK - x.shape[1])), constant_values=fill)
    return x.reshape(x.shape[0], num_blocks, BLOCK)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(x, k) over the rows of [S, V] x, the same values and ids, ties included
    (the lower id first); NaN rows excepted. On CPU XLA's own; elsewhere `_blocked_top_k`,
    since XLA:GPU sorts whole rows for a k above its top-k kernel's 16: at 64 rows of a
    128,256-token vocabulary its segmented radix sorts took 2.0 of an 11 ms step on an
    H200 (docs/performance-log.md, "The kit on an H200, traced")."""
    return lax.platform_dependent(x, cpu=lambda x: tuple(lax.top_k(x, k)),
                                  default=lambda x: _blocked_top_k(x, k))


def _blocked_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`top_k` from the k BLOCK-wide blocks with the largest maxima, in id order: a top_k of
    [S, V / BLOCK] block maxima and one of [S, k * BLOCK] candidates instead of [S, V].

    Exact: an element of the top k lies in a block whose maximum is at least its value, and
    at most k - 1 blocks hold larger elements or equal ones of lower id, so its block is
    among the k chosen (block ties go to the lower block). Kept in ascending block order, the
    candidates' positions follow their ids, so ties break as lax.top_k breaks them."""
    num_rows = x.shape[0]
    blocks = _blocks(x, -jnp.inf)                                              # [S, B, D]
    if k * 2 > blocks.shape[1]:  # too few blocks for the first cut to pay
        return tuple(lax.top_k(x, k))
    _, chosen = lax.top_k(jnp.max(blocks, axis=-1), k)                         # [S, k]
    # ascending block order without a sort: each block's rank among the k chosen
    rank = jnp.sum(chosen[:, None, :] < chosen[:, :, None], axis=-1)           # [S, k]
    rows = jnp.arange(num_rows)[:, None]
    chosen = jnp.zeros_like(chosen).at[rows, rank].set(chosen)
    candidates = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1)       # [S, k, D]
    values, at = lax.top_k(candidates.reshape(num_rows, k * BLOCK), k)
    ids = jnp.take_along_axis(chosen, at // BLOCK, axis=-1) * BLOCK + at % BLOCK
    return values, ids.astype(jnp.int32)


def _to_ordered(f: jax.Array) -> jax.Array:
    """f32 -> i32 whose order is the float order (an involution, see _from_ordered)."""
    i = lax.bitcast_convert_type(f, jnp.int32)
    return jnp.where(i < 0, i ^ 0x7FFFFFFF, i)


def _from_ordered(i: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(jnp.where(i < 0, i ^ 0x7FFFFFFF, i), jnp.float32)


def _largest_cutoff(x: jax.Array, mass_at_least: Callable[[jax.Array], jax.Array],
                    target: jax.Array) -> jax.Array:
    """Per row, the largest value v of x with mass_at_least(v) >= target: [S, 1].

    `mass_at_least(v)` ([S, W] thresholds -> [S, W] masses) must be non-increasing in v, and
    the row minimum must reach the target. A search on the float's bit pattern, exact: the
    ordered range spans at most 2^32. On CPU a bisection, 32 passes over [S, V] of one
    threshold each; elsewhere `_search_ways`, 8 passes of 15 thresholds each, since a
    GPU's cost is its kernels, not its arithmetic (the bisection's loop was ~450 of a step's
    ~1,170 kernels on an H200: docs/performance-log.md, "The kit on an H200, traced"). Both
    find the same value, the one that exists.
    """
    lo = _to_ordered(jnp.min(x, axis=-1, keepdims=True))   # invariant: mass(lo) >= target
    hi = _to_ordered(jnp.max(x, axis=-1, keepdims=True)) + 1  # invariant: mass(hi) < target
    return lax.platform_dependent(
        lo, hi, target, cpu=lambda *a: _bisect(mass_at_least, *a),
        default=lambda *a: _search_ways(mass_at_least, *a))


def _bisect(mass_at_least, lo, hi, target):
    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        ok = mass_at_least(_from_ordered(mid)) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = lax.fori_loop(0, 32, step, (lo, hi))
    # mass(lo) > mass(lo + 1), so some element of x has exactly this value.
    return _from_ordered(lo)


WAYS = 16  # `_search_ways` cuts its range in 16 a pass: 8 passes cover 2^32


def _search_ways(mass_at_least, lo, hi, target):
    """`_bisect`'s answer in 8 unrolled passes, each testing the WAYS - 1 points that cut
    [lo, hi) into WAYS parts (a pass's range is at most ceil(its last / WAYS)). The tests
    that pass are a prefix (the points rise, the mass falls), so their number n names the
    next range, [point n, point n + 1) with point 0 = lo and point WAYS = hi, computed as
    the points are rather than gathered from them (on a GPU a gather and a concatenation
    were about a kernel more a pass)."""
    u32 = lambda a: lax.bitcast_convert_type(a, jnp.uint32)
    start = u32(lo)
    width = u32(hi) - start  # the range's width, < 2^32, modulo 2^32

    def point(j):  # start + floor(j * width / WAYS), without overflow, modulo 2^32
        return start + j * (width // WAYS) + (j * (width % WAYS)) // WAYS

    j = jnp.arange(1, WAYS, dtype=jnp.uint32)                                  # [W - 1]
    for _ in range(8):
        points = lax.bitcast_convert_type(point(j), jnp.int32)                 # [S, W - 1]
        ok = mass_at_least(_from_ordered(points)) >= target                    # a prefix true
        n = jnp.sum(ok, axis=-1, keepdims=True, dtype=jnp.uint32)              # [S, 1]
        start, width = point(n), point(n + 1) - point(n)
    return _from_ordered(lax.bitcast_convert_type(start, jnp.int32))


def _bisect_top_k(x: jax.Array, k: jax.Array) -> jax.Array:
    """[S, 1]: the k-th largest value of each row of x ([S, 1] k in [1, V])."""
    return _largest_cutoff(x, lambda v: jnp.sum(x[:, None, :] >= v[:, :, None], axis=-1), k)


def _bisect_top_p(w: jax.Array, target: jax.Array) -> jax.Array:
    """[S, 1]: the largest weight v with sum(w[w >= v]) >= target."""
    return _largest_cutoff(w, lambda v: jnp.sum(
        jnp.where(w[:, None, :] >= v[:, :, None], w[:, None, :], 0.0), axis=-1), target)
