"""A GPU matmul that reads one layer's weight out of the layer stack in place (Pallas,
lowered to Triton): `stacked_matmul(x, stack, layer)` = x @ stack[layer]^T, for float
weights, per-channel int8 ones (`scale`, converted in the read and applied to the sums), and
the group formats of ops/quantization.py (`scale` [L, O, G] and optionally `minimum`): int8
values or 4-bit ones packed two a byte (uint8 [L, O, I / 2], `pack`'s layout), dequantized
in registers as they are read.

Why: the model scans its layers over stacked weights [L, O, I], and XLA:GPU copies each
layer's [O, I] slice out of the stack before its cuBLAS product, three passes over the
bytes where one would do (docs/performance-log.md, "Weights read in place on an H100", has
the times). At one row a multiply and a sum also reads in place
(ops/xla_linear.row_sums); from a few rows up a dot is needed, and this kernel takes
the whole stack and the layer index, so nothing is copied. XLA's own int4 products read
0.02-0.13 of the copy rate on an H200 at 1 and 64 rows ("The first in-place-weights run on
a GPU"), so group formats come here at one row too.

Each program multiplies the rows by one block of `block_n` output channels over
1/`splits` of the inputs, `block_k` at a time: from 2 rows as a dot (rows padded to at
least 16, Triton's smallest), one row as a multiply whose sums are kept per piece of 32
inputs (per group in a group format) until the last step, so that a program sums across
its threads once (a sum across threads every step read int8 at 0.29-0.41 of the copy rate
on an H200, where XLA's own multiply and sum read 0.47-0.52; 2026-11-28). With
several splits the partial sums (float32) are added after the kernel; they give a matrix
of few output channels (Llama-3-8B's k and v projections: 1,024) enough programs to fill
the GPU. A group format's block is whole groups, [block_n, groups, group values] (the
stack seen as [L, O, G, I / G], a view): one row sums each group's products and scales the
group's sum (and adds a minimum times the group's sum of x), each block's groups kept apart
until the last step (one sum across threads a program, not one a step); more rows
dequantize the block in x's dtype for the dot. Block sizes are first guesses, measured by
`python -m engine.bench.quantization --formats float-pallas,int8-pallas,int4-pallas` (and
`@BNxBKxSPLITSxWARPSxSTAGES` variants).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

MIN_ROWS = 16  # Triton's smallest dot
MAX_ROWS = 128  # beyond this a copy of the layer costs little beside the product
TARGET_PROGRAMS = 256  # about two per multiprocessor of an H100 or H200 (132)
# A group format's block at one row: about this many values a part (4-bit values are two
# parts, the low and the high nibbles), so that each thread's share stays in registers.
GROUP_BLOCK_VALUES = 8192


def _pick(n: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sizes if n % s == 0), None)


def _splits(programs: int, steps: int) -> int:
    """Splits of `steps` blocks of inputs so that about TARGET_PROGRAMS programs run, each
    with at least 4 steps."""
    splits = 1
    while (programs * splits < TARGET_PROGRAMS and steps % (2 * splits) == 0
           and steps // (2 * splits) >= 4):
        splits *= 2
    return splits


def block_sizes(out_f: int, in_f: int, rows: int = 2, group: int = 0,
                packed: bool = False) -> tuple[int, int, int] | None:
    """(block_n, block_k, splits) for an [out_f, in_f] weight at `rows` rows, or None when
    no block of at least 16 divides it. One row reads longer blocks of inputs (the faster
    block at one row in docs/performance-log.md, "Weights read in place on an H100"). A
    group format (`group` inputs a scale, 4-bit values `packed`) takes whole groups a block,
    a power of two of them that divides the row's groups."""
    block_n = _pick(out_f, (64, 32, 16))
    if block_n is None:
        return None
    if group:
        width = group // 2 if packed else group  # values of a group a part
        groups = in_f // group
        most = max(1, GROUP_BLOCK_VALUES // (block_n * width)) if rows == 1 else max(
            1, 128 // width)
        per_block = _pick(groups, tuple(1 << i for i in range(most.bit_length() - 1, -1, -1)))
        block_k = per_block * group
    else:
        block_k = _pick(in_f, (256, 128, 64, 32, 16) if rows == 1 else (128, 64, 32, 16))
        if block_k is None:
            return None
    return block_n, block_k, _splits(out_f // block_n, in_f // block_k)


def group_of(scale: jax.Array | None, in_f: int) -> int:
    """Inputs a scale covers in a group format (0: a float stack or per-channel scales)."""
    if scale is None or scale.shape[-1] == 1:
        return 0
    return in_f // scale.shape[-1]


def fits(x: jax.Array, stack: jax.Array, scale: jax.Array | None = None,
         minimum: jax.Array | None = None) -> bool:
    """Whether `stacked_matmul` takes these: 2-D rows (at most MAX_ROWS), an [L, O, I] stack
    of x's input size (I / 2 packed), block sizes that divide it, and a float stack, int8
    with per-channel scales [L, O, 1], or a group format: int8 values, or 4-bit ones packed
    in uint8, with scales (and minimums) [L, O, G] for groups of a power of two inputs (at
    least 16; 32 packed)."""
    if not (x.ndim == 2 and 0 < x.shape[0] <= MAX_ROWS and stack.ndim == 3):
        return False
    rows, in_f = x.shape
    packed = stack.dtype == jnp.uint8
    if stack.shape[2] * (2 if packed else 1) != in_f:
        return False
    if scale is None:
        return (minimum is None and jnp.issubdtype(stack.dtype, jnp.floating)
                and block_sizes(stack.shape[1], in_f, rows) is not None)
    if stack.dtype not in (jnp.int8, jnp.uint8) or scale.shape[:2] != stack.shape[:2]:
        return False
    if minimum is not None and minimum.shape != scale.shape:
        return False
    group = group_of(scale, in_f)
    if not group:  # per channel: int8, no minimums
        return (not packed and minimum is None
                and block_sizes(stack.shape[1], in_f, rows) is not None)
    return (in_f % group == 0 and group & (group - 1) == 0 and group >= (32 if packed else 16)
            and block_sizes(stack.shape[1], in_f, rows, group, packed) is not None)


def _float_block(layer, x_ref, w_ref, scale_ref, n, split, *, block_n, block_k, steps,
                 one_row):
    """One float (or per-channel int8) matrix's block of channels `n`, split `split`:
    [bn] sums (one row) or [R, bn]. One row reads views in pieces of W inputs (x [1, I / W,
    W], the stack [L, O, I / W, W]) and keeps each block's pieces apart until the last step:
    one sum across threads a program, not one a step."""
    channels = pl.ds(n * block_n, block_n)
    if one_row:
        width = w_ref.shape[3]
        pieces = block_k // width

        def row_body(i, acc):
            g = pl.ds(pl.multiple_of((split * steps + i) * pieces, pieces), pieces)
            wb = w_ref[layer, channels, g, :]                        # [bn, pieces, W]
            xb = x_ref[0, g, :].astype(jnp.float32)                  # [pieces, W]
            return acc + jnp.sum(wb.astype(jnp.float32) * xb[None], axis=2)

        acc = jax.lax.fori_loop(0, steps, row_body,
                                jnp.zeros((block_n, pieces), jnp.float32))
        acc = jnp.sum(acc, axis=1)
    else:
        def body(i, acc):
            k0 = pl.multiple_of((split * steps + i) * block_k, block_k)
            xb = x_ref[:, pl.ds(k0, block_k)]                        # [R, bk]
            wb = w_ref[layer, channels, pl.ds(k0, block_k)]          # [bn, bk]
            # HIGHEST: float32 inputs get an IEEE dot instead of TF32; no effect on bf16.
            return acc + pl_triton.dot(xb, wb.astype(xb.dtype), trans_b=True,
                                       precision=jax.lax.Precision.HIGHEST)

        acc = jax.lax.fori_loop(0, steps, body,
                                jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    if scale_ref is not None:  # int8: one scale per output channel, applied to the sums
        acc = acc * scale_ref[layer, channels, 0].astype(jnp.float32)
    return acc


def _group_block(layer, x_ref, w_ref, s_ref, m_ref, n, split, *, block_n, groups, steps,
                 one_row, packed):
    """One group-format matrix's block of channels `n`, split `split`. x_ref: the rows as
    [R, I / 32, 32] when `packed` (each block of 32 inputs: its first 16 meet the low
    nibbles, the rest the high ones), else [R, G, group]; w_ref the values [L, O, G, W];
    s_ref the scales [L, O, G]; m_ref the minimums or None. Both views of x and w are
    bitcasts: nothing is prepared outside the kernel."""
    channels = pl.ds(n * block_n, block_n)
    rows = x_ref.shape[0]
    width = w_ref.shape[3]  # values of a group a part
    per_group = 2 * width // 32 if packed else 1  # blocks of 32 inputs a group (packed)

    def body(i, acc):
        g0 = pl.multiple_of((split * steps + i) * groups, groups)
        g = pl.ds(g0, groups)
        wb = w_ref[layer, channels, g, :]                            # [bn, ng, W]
        sc = s_ref[layer, channels, g].astype(jnp.float32)           # [bn, ng]
        if m_ref is not None:
            mn = m_ref[layer, channels, g].astype(jnp.float32)
        elif packed:  # symmetric values are stored plus 8
            mn = -8.0 * sc
        else:
            mn = None
        if packed:
            blocks = pl.ds(pl.multiple_of(g0 * per_group, per_group), groups * per_group)
            xs = [x_ref[:, blocks, pl.ds(16 * h, 16)].reshape(rows, groups, width)
                  for h in (0, 1)]                                   # [R, ng, W] each
            values = (wb & 15, wb >> 4)
        else:
            xs, values = [x_ref[:, g, :]], (wb,)
        if one_row:  # each group's products summed, then its scale (and minimum) once
            xf = [xr[0].astype(jnp.float32) for xr in xs]            # [ng, W]
            sums = sum(jnp.sum(v.astype(jnp.float32) * xr[None], axis=2)
                       for v, xr in zip(values, xf, strict=True))
            part = sc * sums
            if mn is not None:
                part = part + mn * sum(jnp.sum(xr, axis=1) for xr in xf)[None, :]
            return acc + part  # [bn, ng]: summed over the groups once, after the loop
        for v, xr in zip(values, xs, strict=True):
            w = v.astype(jnp.float32) * sc[:, :, None]
            if mn is not None:
                w = w + mn[:, :, None]
            w = w.astype(xr.dtype).reshape(block_n, groups * width)
            acc = acc + pl_triton.dot(xr.reshape(rows, groups * width), w, trans_b=True,
                                      precision=jax.lax.Precision.HIGHEST)
        return acc

    shape = (block_n, groups) if one_row else (rows, block_n)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(shape, jnp.float32))
    return jnp.sum(acc, axis=1) if one_row else acc


def _kernel(layer_ref, x_ref, *refs, starts, parts, slots, block):
    """The matrices' blocks of channels side by side along the grid's first axis: program n
    computes the block of the matrix whose channels it falls in (`starts`: each matrix's
    first block, then their total), through `block` (`_float_block` or `_group_block`,
    which takes `slots` refs a matrix: values, scales and minimums, None where a matrix has
    fewer, `parts`)."""
    *refs, o_ref = refs
    n, split = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]

    def run(m):
        mine = list(refs[m * parts:(m + 1) * parts]) + [None] * (slots - parts)
        acc = block(layer, x_ref, *mine, n - starts[m], split)
        o_ref[...] = acc.reshape(o_ref.shape).astype(o_ref.dtype)

    if len(starts) == 2:  # one matrix
        run(0)
        return
    for m in range(len(starts) - 1):
        pl.when((n >= starts[m]) & (n < starts[m + 1]))(functools.partial(run, m))


def _kind(x: jax.Array, w: dict) -> tuple:
    """What must be alike for products in one call: the values' dtype and shape past the
    channels, the group, whether there are scales and minimums."""
    stack, scale = w["stack"], w.get("scale")
    return (stack.dtype, stack.shape[0], stack.shape[2], group_of(scale, x.shape[1]),
            scale is None, w.get("min") is None)


def alike(x: jax.Array, mats: list[dict]) -> bool:
    """Whether `stacked_matmuls` takes these matrices in one call (each of them `fits`)."""
    return len({_kind(x, w) for w in mats}) == 1


def stacked_matmuls(x: jax.Array, mats: list[dict], layer, out_dtype=None, *,
                    interpret: bool | None = None, block_n: int | None = None,
                    block_k: int | None = None, splits: int | None = None,
                    num_warps: int = 4, num_stages: int = 4) -> list[jax.Array]:
    """x [T, I] @ stack[layer]^T -> [T, O] for each of `mats` ({"stack", "scale", "min"}, as
    `stacked_matmul` takes them, all of one kind: a layer's q, k and v, its gate and up) in
    one kernel, its grid the matrices' blocks of channels side by side."""
    for w in mats:
        if not fits(x, w["stack"], w.get("scale"), w.get("min")):
            raise ValueError(
                f"stacked_matmul takes [T <= {MAX_ROWS}, I] rows and a float [L, O, I] "
                f"stack, int8 with [L, O, 1] scales, or a group format (int8 or packed 4-bit "
                f"values, [L, O, G] scales) with blocks dividing it, got {x.shape} and "
                f"{w['stack'].shape} {w['stack'].dtype}")
    if not alike(x, mats):
        raise ValueError("matrices multiplied in one call must be of one kind (dtype, "
                         "layers, inputs, group, scales and minimums)")
    rows, in_f = x.shape
    first = mats[0]["stack"]
    packed = first.dtype == jnp.uint8
    group = group_of(mats[0].get("scale"), in_f)
    out_fs = [w["stack"].shape[1] for w in mats]
    guesses = [block_sizes(o, in_f, rows, group, packed) for o in out_fs]
    block_n = block_n or min(g[0] for g in guesses)
    block_k = block_k or guesses[0][1]
    if not splits:
        splits = _splits(sum(out_fs) // block_n, in_f // block_k)
    if (any(o % block_n for o in out_fs) or in_f % (block_k * splits)
            or (group and (block_k % group or (block_k // group) & (block_k // group - 1)))):
        whole = f" in whole groups of {group} (a power of two a block)" if group else ""
        raise ValueError(f"blocks of {block_n} x {block_k} in {splits} splits do not divide "
                         f"{out_fs} x {in_f}{whole}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    arrays = [(w["stack"], w.get("scale"), w.get("min")) for w in mats]
    return list(_matmuls(x, arrays, jnp.asarray(layer, jnp.int32),
                         out_dtype=jnp.dtype(out_dtype or x.dtype), interpret=bool(interpret),
                         block_n=block_n, block_k=block_k, splits=splits, group=group,
                         num_warps=num_warps, num_stages=num_stages))


def stacked_matmul(x: jax.Array, stack: jax.Array, layer, out_dtype=None, *,
                   scale: jax.Array | None = None, minimum: jax.Array | None = None,
                   **options) -> jax.Array:
    """x [T, I] @ stack[layer]^T -> [T, O] in `out_dtype` (default x's), read in place; an
    int8 `stack` takes its per-channel `scale` [L, O, 1], a group format its `scale` (and
    `minimum`) [L, O, G] (see `fits`). `options`: `interpret` (None: unless the backend is
    a GPU), and the block sizes (`block_n`, `block_k` in inputs, `splits`; those left as None
    are `block_sizes`'s), `num_warps`, `num_stages`."""
    mat = {"stack": stack}
    if scale is not None:
        mat["scale"] = scale
    if minimum is not None:
        mat["min"] = minimum
    return stacked_matmuls(x, [mat], layer, out_dtype, **options)[0]


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_n", "block_k",
                                             "splits", "group", "num_warps", "num_stages"))
def _matmuls(x, arrays, layer, *, out_dtype, interpret, block_n, block_k, splits, group,
             num_warps, num_stages):
    rows, in_f = x.shape
    one_row = rows == 1
    padded = 1 if one_row else max(MIN_ROWS, 1 << (rows - 1).bit_length())
    stack0, scale0, min0 = arrays[0]
    packed = stack0.dtype == jnp.uint8
    if jnp.issubdtype(stack0.dtype, jnp.floating):
        compute = stack0.dtype
    else:  # quantized values convert to the rows' dtype
        compute = x.dtype
    xp = jnp.pad(x.astype(compute), ((0, padded - rows), (0, 0)))
    steps = in_f // block_k // splits
    part_dtype = out_dtype if splits == 1 else jnp.float32
    out_fs = [stack.shape[1] for stack, _, _ in arrays]
    starts = tuple(int(v) for v in np.cumsum([0] + [o // block_n for o in out_fs]))
    operands = [layer.reshape(1)]
    if group:  # views (bitcasts) of the rows and the stack: see `_group_block`
        groups = in_f // group
        operands.append(xp.reshape(padded, in_f // 32, 32) if packed
                        else xp.reshape(padded, groups, group))
        for stack, scale, minimum in arrays:
            operands += [stack.reshape(*stack.shape[:2], groups, -1), scale]
            operands += [] if minimum is None else [minimum]
        block = functools.partial(_group_block, block_n=block_n, groups=block_k // group,
                                  steps=steps, one_row=one_row, packed=packed)
        parts = 2 + (min0 is not None)
    else:
        width = min(32, block_k)  # one row: views in pieces of `width` inputs
        operands.append(xp.reshape(1, in_f // width, width) if one_row else xp)
        for stack, scale, _ in arrays:
            view = stack.reshape(*stack.shape[:2], in_f // width, width) if one_row else stack
            operands += [view] + ([] if scale is None else [scale])
        block = functools.partial(_float_block, block_n=block_n, block_k=block_k,
                                  steps=steps, one_row=one_row)
        parts = 1 + (scale0 is not None)
    whole = pl.BlockSpec()  # the full array, indexed inside the kernel
    out = pl.pallas_call(
        functools.partial(_kernel, starts=starts, parts=parts, slots=3 if group else 2,
                          block=block),
        grid=(starts[-1], splits),
        in_specs=[whole] * len(operands),
        out_specs=pl.BlockSpec((None, padded, block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, padded, sum(out_fs)), part_dtype),
        interpret=interpret,
        # Picks the Triton lowering (else jax 0.10 lowers to Mosaic GPU); num_warps and
        # num_stages are first guesses.
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="stacked_matmul",
    )(*operands)
    out = (out[0] if splits == 1 else out.sum(0))[:rows].astype(out_dtype)
    ends = np.cumsum(out_fs)
    return tuple(out[:, e - o:e] for o, e in zip(out_fs, ends, strict=True))
