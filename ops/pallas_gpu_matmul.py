"""A GPU matmul that reads one layer's weight out of the layer stack in place (Pallas,
lowered to Triton): `stacked_matmul(x, stack, layer)` = x @ stack[layer]^T, for float
weights and per-channel int8 ones (`scale`, converted in the read and applied to the sums).

Why: the model scans its layers over stacked weights [L, O, I], and XLA:GPU copies each
layer's [O, I] slice out of the stack before its cuBLAS product, three passes over the
bytes where one would do (docs/performance-log.md, "Weights read in place on an H100", has
the times). At one row a multiply and a sum also reads in place
(ops/quantized_linear.row_sums); from a few rows up a dot is needed, and this kernel takes
the whole stack and the layer index, so nothing is copied.

Each program multiplies the rows by one block of `block_n` output channels over
1/`splits` of the inputs, `block_k` at a time: from 2 rows as a dot (rows padded to at
least 16, Triton's smallest), one row as a multiply and a sum over each block. With
several splits the partial sums (float32) are added after the kernel; they give a matrix
of few output channels (Llama-3-8B's k and v projections: 1,024) enough programs to fill
the GPU. Block sizes are first guesses, measured by `python -m engine.bench.quantization
--formats float-pallas,int8-pallas` (and `@BNxBKxSPLITSxWARPSxSTAGES` variants).
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


def block_sizes(out_f: int, in_f: int, rows: int = 2) -> tuple[int, int, int] | None:
    """(block_n, block_k, splits) for an [out_f, in_f] weight at `rows` rows, or None when
    no block of at least 16 divides it. One row reads longer blocks of inputs (the faster
    block at one row in docs/performance-log.md, "Weights read in place on an H100")."""
    block_n = _pick(out_f, (64, 32, 16))
    block_k = _pick(in_f, (256, 128, 64, 32, 16) if rows == 1 else (128, 64, 32, 16))
    if block_n is None or block_k is None:
        return None
    steps, splits = in_f // block_k, 1
    while (out_f // block_n * splits < TARGET_PROGRAMS and steps % (2 * splits) == 0
           and steps // (2 * splits) >= 4):
        splits *= 2
    return block_n, block_k, splits


def fits(x: jax.Array, stack: jax.Array, scale: jax.Array | None = None) -> bool:
    """Whether `stacked_matmul` takes these: 2-D rows (at most MAX_ROWS), an [L, O, I] stack
    of x's input size, float or int8 with per-channel scales [L, O, 1], and block sizes
    that divide it."""
    if not (x.ndim == 2 and 0 < x.shape[0] <= MAX_ROWS and stack.ndim == 3
            and stack.shape[2] == x.shape[1]
            and block_sizes(stack.shape[1], stack.shape[2], x.shape[0]) is not None):
        return False
    if scale is None:
        return jnp.issubdtype(stack.dtype, jnp.floating)
    return stack.dtype == jnp.int8 and scale.shape == (*stack.shape[:2], 1)


def _kernel(layer_ref, x_ref, w_ref, *rest, block_n, block_k, steps, one_row):
    *scale_ref, o_ref = rest
    n, split = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    channels = pl.ds(n * block_n, block_n)

    def body(i, acc):
        k0 = pl.multiple_of((split * steps + i) * block_k, block_k)
        xb = x_ref[:, pl.ds(k0, block_k)]                            # [R, bk]
        wb = w_ref[layer, channels, pl.ds(k0, block_k)]              # [bn, bk]
        if one_row:  # a multiply and a sum: no dot of one row
            return acc + jnp.sum(wb.astype(jnp.float32) * xb.astype(jnp.float32), axis=1)
        # HIGHEST: float32 inputs get an IEEE dot instead of TF32; no effect on bf16.
        return acc + pl_triton.dot(xb, wb.astype(xb.dtype), trans_b=True,
                                   precision=jax.lax.Precision.HIGHEST)

    shape = (block_n,) if one_row else (x_ref.shape[0], block_n)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(shape, jnp.float32))
    if scale_ref:  # int8: one scale per output channel, applied to the sums
        acc = acc * scale_ref[0][layer, channels, 0].astype(jnp.float32)
    o_ref[...] = acc.reshape(o_ref.shape).astype(o_ref.dtype)


def stacked_matmul(x: jax.Array, stack: jax.Array, layer, out_dtype=None, *,
                   scale: jax.Array | None = None, interpret: bool | None = None,
                   block_n: int | None = None, block_k: int | None = None,
                   splits: int | None = None, num_warps: int = 4,
                   num_stages: int = 4) -> jax.Array:
    """x [T, I] @ stack[layer]^T -> [T, O] in `out_dtype` (default x's), read in place; an
    int8 `stack` takes its per-channel `scale` [L, O, 1]. `interpret=None` interprets
    unless the backend is a GPU; the block sizes left as None are `block_sizes`'s."""
    if not fits(x, stack, scale):
        raise ValueError(f"stacked_matmul takes [T <= {MAX_ROWS}, I] rows and a float (or "
                         f"int8 with [L, O, 1] scales) [L, O, I] stack with blocks dividing "
                         f"it, got {x.shape} and {stack.shape} {stack.dtype}")
    guess = block_sizes(stack.shape[1], stack.shape[2], x.shape[0])
    block_n, block_k, splits = (block_n or guess[0], block_k or guess[1], splits or guess[2])
    if stack.shape[1] % block_n or stack.shape[2] % (block_k * splits):
        raise ValueError(f"blocks of {block_n} x {block_k} in {splits} splits do not divide "
                         f"[{stack.shape[1]}, {stack.shape[2]}]")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _matmul(x, stack, jnp.asarray(layer, jnp.int32), scale, out_dtype=jnp.dtype(
        out_dtype or x.dtype), interpret=bool(interpret), block_n=block_n, block_k=block_k,
        splits=splits, num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_n", "block_k",
                                             "splits", "num_warps", "num_stages"))
def _matmul(x, stack, layer, scale, *, out_dtype, interpret, block_n, block_k, splits,
            num_warps, num_stages):
    rows, in_f = x.shape
    out_f = stack.shape[1]
    one_row = rows == 1
    padded = 1 if one_row else max(MIN_ROWS, 1 << (rows - 1).bit_length())
    compute = stack.dtype if scale is None else x.dtype  # int8 converts to the rows' dtype
    xp = jnp.pad(x.astype(compute), ((0, padded - rows), (0, 0)))
    steps = in_f // block_k // splits
    part_dtype = out_dtype if splits == 1 else jnp.float32
    whole = pl.BlockSpec()  # the full array, indexed inside the kernel
    operands = (layer.reshape(1), xp, stack) + (() if scale is None else (scale,))
    parts = pl.pallas_call(
        functools.partial(_kernel, block_n=block_n, block_k=block_k, steps=steps,
                          one_row=one_row),
        grid=(out_f // block_n, splits),
        in_specs=[whole] * len(operands),
        out_specs=pl.BlockSpec((None, padded, block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, padded, out_f), part_dtype),
        interpret=interpret,
        # Picks the Triton lowering (else jax 0.10 lowers to Mosaic GPU); num_warps and
        # num_stages are first guesses.
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="stacked_matmul",
    )(*operands)
    out = parts[0] if splits == 1 else parts.sum(0)
    return out[:rows].astype(out_dtype)
