"""A GPU matmul that reads one layer's weight out of the layer stack in place (Pallas,
lowered to Triton): `stacked_matmul(x, stack, layer)` = x @ stack[layer]^T.

Why: the model scans its layers over stacked weights [L, O, I], and XLA:GPU copies each
layer's [O, I] slice out of the stack before its cuBLAS product, three passes over the
bytes where one would do (an H200: a 4096 x 14336 bfloat16 layer at 64 rows took 0.163 ms
scanned against 0.052 ms with the layer as its own array; docs/performance.md). At one row
a multiply and a sum reads in place (ops/quantized_linear.row_sums); from a few rows up a
dot is needed, and this kernel takes the whole stack and the layer index, so nothing is
copied.

Each program multiplies the rows (padded to at least 16, Triton's smallest dot) by one
block of `block_n` output channels over 1/`splits` of the inputs, `block_k` at a time;
with several splits the partial sums (float32) are added after the kernel. The splits give
a matrix of few output channels (Llama-3-8B's k and v projections: 1,024) enough programs
to fill the GPU. Block sizes are first guesses, measured by `python -m ops.bench_quantization
--formats float-pallas` against XLA's product of a separate array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

MIN_ROWS = 16  # Triton's smallest dot
MAX_ROWS = 128  # beyond this a copy of the layer costs little beside the product
TARGET_PROGRAMS = 256  # about two per multiprocessor of an H100 or H200 (132)


def _pick(n: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sizes if n % s == 0), None)


def block_sizes(out_f: int, in_f: int) -> tuple[int, int, int] | None:
    """(block_n, block_k, splits) for an [out_f, in_f] weight, or None when no block of
    at least 16 divides it."""
    block_n = _pick(out_f, (64, 32, 16))
    block_k = _pick(in_f, (128, 64, 32, 16))
    if block_n is None or block_k is None:
        return None
    steps, splits = in_f // block_k, 1
    while (out_f // block_n * splits < TARGET_PROGRAMS and steps % (2 * splits) == 0
           and steps // (2 * splits) >= 4):
        splits *= 2
    return block_n, block_k, splits


def fits(x: jax.Array, stack: jax.Array) -> bool:
    """Whether `stacked_matmul` takes these: 2-D rows (at most MAX_ROWS), a float [L, O, I]
    stack of x's input size, and block sizes that divide it."""
    return (x.ndim == 2 and 0 < x.shape[0] <= MAX_ROWS and stack.ndim == 3
            and jnp.issubdtype(stack.dtype, jnp.floating) and stack.shape[2] == x.shape[1]
            and block_sizes(stack.shape[1], stack.shape[2]) is not None)


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, block_n, block_k, steps):
    n, split = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]

    def body(i, acc):
        k0 = pl.multiple_of((split * steps + i) * block_k, block_k)
        xb = x_ref[:, pl.ds(k0, block_k)]                                   # [R, bk]
        wb = w_ref[layer, pl.ds(n * block_n, block_n), pl.ds(k0, block_k)]  # [bn, bk]
        # HIGHEST: float32 inputs get an IEEE dot instead of TF32; no effect on bf16.
        return acc + pl_triton.dot(xb, wb, trans_b=True, precision=jax.lax.Precision.HIGHEST)

    rows = x_ref.shape[0]
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def stacked_matmul(x: jax.Array, stack: jax.Array, layer, out_dtype=None, *,
                   interpret: bool | None = None, block_n: int | None = None,
                   block_k: int | None = None, splits: int | None = None,
                   num_warps: int = 4, num_stages: int = 4) -> jax.Array:
    """x [T, I] @ stack[layer]^T -> [T, O] in `out_dtype` (default x's), read in place.
    `interpret=None` interprets unless the backend is a GPU; the block sizes left as None
    are `block_sizes`'s."""
    if not fits(x, stack):
        raise ValueError(f"stacked_matmul takes [T <= {MAX_ROWS}, I] rows and a float "
                         f"[L, O, I] stack with blocks dividing it, got {x.shape} and "
                         f"{stack.shape} {stack.dtype}")
    guess = block_sizes(stack.shape[1], stack.shape[2])
    block_n, block_k, splits = (block_n or guess[0], block_k or guess[1], splits or guess[2])
    if stack.shape[1] % block_n or stack.shape[2] % (block_k * splits):
        raise ValueError(f"blocks of {block_n} x {block_k} in {splits} splits do not divide "
                         f"[{stack.shape[1]}, {stack.shape[2]}]")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _matmul(x, stack, jnp.asarray(layer, jnp.int32), out_dtype=jnp.dtype(
        out_dtype or x.dtype), interpret=bool(interpret), block_n=block_n, block_k=block_k,
        splits=splits, num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_n", "block_k",
                                             "splits", "num_warps", "num_stages"))
def _matmul(x, stack, layer, *, out_dtype, interpret, block_n, block_k, splits, num_warps,
            num_stages):
    rows, in_f = x.shape
    out_f = stack.shape[1]
    padded = max(MIN_ROWS, 1 << (rows - 1).bit_length())
    xp = jnp.pad(x.astype(stack.dtype), ((0, padded - rows), (0, 0)))
    steps = in_f // block_k // splits
    part_dtype = out_dtype if splits == 1 else jnp.float32
    whole = pl.BlockSpec()  # the full array, indexed inside the kernel
    parts = pl.pallas_call(
        functools.partial(_kernel, block_n=block_n, block_k=block_k, steps=steps),
        grid=(out_f // block_n, splits),
        in_specs=[whole, whole, whole],
        out_specs=pl.BlockSpec((None, padded, block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, padded, out_f), part_dtype),
        interpret=interpret,
        # Picks the Triton lowering (else jax 0.10 lowers to Mosaic GPU); num_warps and
        # num_stages are first guesses.
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="stacked_matmul",
    )(layer.reshape(1), xp, stack)
    out = parts[0] if splits == 1 else parts.sum(0)
    return out[:rows].astype(out_dtype)
