"""XLA's own forms of `linear` (ops/quantized_linear.py), chosen per static shape from
measurements on XLA:CPU and XLA:GPU (docs/performance.md):

- on a GPU, one row: a multiply and a sum (`row_sums`), which XLA fuses with the layer's
  slice and the dequantization, reading the stored values in place;
- elsewhere, one row: the dequantization written as an elementwise function of [O, I]
  fuses into XLA's matrix-vector product, which then reads int8 instead of float32;
- more rows: per-channel scales are applied to the dot's output. Group formats are
  dequantized whole when the result fits in CHUNK_BYTES, else CHUNK_BYTES at a time in a
  loop, each block multiplied while it is in cache (`in_blocks`). Smaller blocks cost more
  than they save: each loop iteration has a fixed cost on XLA:CPU ("The default server runs
  its file's 4-bit weights"). Packed 4-bit values: `packed_product`; 8-bit ones in
  the CPU kernel's order (ops/quantization.to_lanes8) are put back in theirs as they
  dequantize. Past the CPU kernel's rows a float32 model may multiply in bfloat16
  (`wide_dtype`).

w8a8 (opt-in) also quantizes each activation row to int8 (its max |x| onto 127) and runs
the dot integer x integer, summed exactly in int32 (`linear_w8a8`): XLA:CPU gives that to
its integer matrix kernels, several times faster than the weight-only product from a few
rows up. The price is accuracy: one scale per row is coarse next to a row's outlier
channels, which models/smoothing.py moves into the weights at load. Scales per block of
inputs were closer but their partial sums cost more than they saved ("int8 activations:
`--quantization w8a8`").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ops.quantization import BLOCK, LANE_BLOCKS, dequantize, to_lanes

# The largest dequantized block at more than one row (the fastest size measured,
# docs/performance.md).
CHUNK_BYTES = 4 << 20
W8A8_MIN_ROWS = 2  # an int8 x int8 product of one row runs padded to this many


def product(x: jax.Array, w, out_dtype, *, chunked: bool = True, wide=None,
            lanes: bool = False) -> jax.Array:
    """x [T, I] @ w [O, I]^T in out_dtype, `w` one layer's float matrix or its quantized parts
    {"q", "scale"[, "min"]} (see the module docstring for the form each takes). `wide`: the
    dtype to multiply in (`wide_dtype`), rounded once from x's; `chunked` and `lanes` as
    `linear` takes them."""
    dot = functools.partial(dot_t, out_dtype=out_dtype)
    if not isinstance(w, dict):
        return dot(x, w) if wide is None else dot(x.astype(wide), w.astype(wide))
    q, scale, minimum = w["q"], w["scale"], w.get("min")
    group = x.shape[-1] // scale.shape[-1]
    if q.dtype == jnp.uint8 and q.shape[-1] == x.shape[-1]:  # 8 bits in the CPU kernel's order
        return in_blocks(x.astype(wide or x.dtype), w, chunked, lambda xw, b: dot(xw, dequantize(
            b["q"], b["scale"], cols=x.shape[-1], dtype=x.dtype).astype(xw.dtype)))
    if q.dtype == jnp.uint8:  # packed 4 bits (the CPU kernel's rows never come here)
        return packed_product(x, w, out_dtype, chunked, wide, lanes)
    if group == x.shape[-1] and minimum is None:  # per-channel: scale the output
        y = dot(x.astype(wide or x.dtype), q.astype(wide or x.dtype))  # int8 values: exact
        return y * scale[:, 0].astype(y.dtype)
    if x.shape[0] == 1:  # fused into the matrix-vector product (see the module docstring)
        full = lambda a: jnp.repeat(a.astype(x.dtype), group, axis=-1)
        wf = q.astype(x.dtype) * full(scale)
        if minimum is not None:
            wf = wf + full(minimum)
        return dot(x, wf)
    # dequantized in x's dtype, then rounded once to `wide`'s
    return in_blocks(x.astype(wide or x.dtype), w, chunked, lambda xw, b: dot(
        xw, dequantize(b["q"], b["scale"], b.get("min"), dtype=x.dtype).astype(xw.dtype)))


WIDE_DTYPES = ("float32", "bfloat16")  # --cpu-matmul-dtype


def wide_dtype(dtype, setting: str = "float32"):
    """The dtype XLA's products of more than NATIVE_MAX_ROWS rows (a prompt's chunk, a batch
    of decodes) multiply in for a model computing in float32 `dtype` on a CPU, summed in
    float32: bfloat16 when `setting` says so, else None (the model's own dtype). Each input
    is then rounded once to bfloat16 (8 significant bits; a dequantized weight from its
    float32 value), which XLA:CPU multiplies on AMX's tiles where the CPU has them (flag
    `amx_bf16`: Sapphire Rapids and later) at ~5-7x its float32 rate (1,374-1,970 against
    229-289 GFLOP/s at 512 x 1536 x 8960 on 2 vCPUs). Not the default: a row's logits then
    move by up to ~0.5 with the rows beside it (more than 8 or not), so a greedy request's
    tokens would depend on what shares its steps. The few rows of a lone decode stay in
    ops/native's float32 and integer products either way."""
    if setting not in WIDE_DTYPES:
        raise ValueError(f"cpu matmul dtype must be one of {', '.join(WIDE_DTYPES)}, "
                         f"got {setting!r}")
    if setting == "float32" or jnp.dtype(dtype) != jnp.float32 or jax.default_backend() != "cpu":
        return None
    return jnp.bfloat16


def dot_t(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    """x [T, I] @ w [O, I]^T, contracting the inputs of both in place: XLA:CPU ran a bfloat16
    `x @ w.T` (a transpose, then a dot) at a sixth of this one's rate (229 against 1,374
    GFLOP/s at 512 x 1536 x 8960, a 2-vCPU Sapphire Rapids)."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def reduces_one_row() -> bool:
    """Whether `linear` runs one row as `row_sums` (on a GPU)."""
    return jax.default_backend() == "gpu"


def row_sums(x: jax.Array, w, out_dtype=None) -> jax.Array:
    """x [T, I] times a float or quantized [O, I] weight as a multiply and a sum over the
    inputs in float32, not a dot: XLA:GPU fuses the weight's slice out of the layer stack
    and its dequantization into one pass over the stored values, where it copies the slice
    (and converts a quantized one) whole before a cuBLAS dot. A GPU runs one row so; from
    a few rows up the sums lose to a dot by far (engine.bench.quantization; docs/performance-log.md,
    "GPU bring-up on an H200, and int8 weights there", "Weights read in place on an
    H100")."""
    if isinstance(w, dict):
        wf = dequantize(w["q"], w["scale"], w.get("min"), dtype=jnp.float32)
    else:
        wf = w.astype(jnp.float32)
    y = (x.astype(jnp.float32)[:, None, :] * wf[None]).sum(-1)
    return y.astype(out_dtype or x.dtype)


def in_blocks(x: jax.Array, w: dict, chunked: bool, multiply) -> jax.Array:
    """`multiply(x, w)` [T, O], over blocks of w's rows that dequantize to at most
    CHUNK_BYTES when `chunked`, each block still in cache when its dot reads it."""
    rows = w["q"].shape[0]
    chunked = chunked and jax.default_backend() == "cpu"  # a CPU's caches; a GPU: one dot
    chunk = chunk_rows(rows, x.shape[-1] * jnp.dtype(x.dtype).itemsize) if chunked else rows
    if chunk == rows:
        return multiply(x, w)
    blocks = jax.tree.map(lambda a: a.reshape(rows // chunk, chunk, *a.shape[1:]), w)
    ys = jax.lax.map(lambda b: multiply(x, b), blocks)  # [O / C, T, C]
    return ys.transpose(1, 0, 2).reshape(x.shape[0], rows)


def packed_product(x: jax.Array, w: dict, out_dtype, chunked: bool, wide=None,
                   lanes: bool = False) -> jax.Array:
    """XLA's product with packed 4-bit values: the low and the high nibbles each dequantize
    elementwise to [O, I / 2] and meet the inputs they hold (the first and the last 16 of
    each block of 32), two dots summed (in `wide`, when given, rounded from x's dtype).
    Interleaving the nibbles back into [O, I] first ran slower at 16-64 rows
    (docs/performance-log.md, "A CPU kernel for quantized matmuls, and 4-bit weights two a
    byte"). Values in the CPU kernel's order (`lanes`) meet x's inputs put in that order:
    their whole groups of 16 blocks dequantize as [O, groups, 4, 16, 4] (`to_lanes`), a
    block's scale broadcast along its parts and bytes, then flattened for the dot; the
    blocks after them go in a second dot. Reordering the values back as they are read, or
    each block's scale broadcast to [O, I / 2] in their order, cost 10-23% at 16 rows."""
    rows_x, cols = x.shape
    xw = x.astype(wide or x.dtype)
    blocks = cols // BLOCK
    whole = blocks // LANE_BLOCKS * LANE_BLOCKS if lanes else 0
    halves = xw.reshape(rows_x, blocks, 2, BLOCK // 2)
    # each input where its value's byte is: x's first and last 16 of each block as the
    # values' low and high nibbles are held
    x_lo, x_hi = (halves[:, :, h].reshape(rows_x, cols // 2) for h in (0, 1))
    if lanes:
        x_lo, x_hi = to_lanes(x_lo, xp=jnp), to_lanes(x_hi, xp=jnp)
    cut = whole * BLOCK // 2
    xg, xt = [x_lo[:, :cut], x_hi[:, :cut]], [x_lo[:, cut:], x_hi[:, cut:]]
    symmetric = "min" not in w

    def multiply(_, b):
        q, scale, minimum = b["q"], b["scale"], b.get("min")
        o = q.shape[0]
        per_group = cols // (scale.shape[-1] * BLOCK)  # blocks a scale covers
        scale = jnp.repeat(scale.astype(x.dtype), per_group, axis=-1)  # [O, blocks]
        shift = (-8 * scale if symmetric else
                 jnp.repeat(minimum.astype(x.dtype), per_group, axis=-1))
        y = 0
        if whole:
            qg = q[:, :whole * BLOCK // 2].reshape(o, whole // LANE_BLOCKS, 4, LANE_BLOCKS, 4)
            sg, hg = (a[:, :whole].reshape(o, whole // LANE_BLOCKS, 1, LANE_BLOCKS, 1)
                      for a in (scale, shift))
            for xh, nibbles in zip(xg, (qg & 15, qg >> 4), strict=True):
                wf = (nibbles.astype(x.dtype) * sg + hg).reshape(o, -1).astype(xh.dtype)
                y = y + dot_t(xh, wf, out_dtype)
        if whole < blocks:
            qt = q[:, whole * BLOCK // 2:].reshape(o, blocks - whole, BLOCK // 2)
            st, ht = scale[:, whole:, None], shift[:, whole:, None]
            for xh, nibbles in zip(xt, (qt & 15, qt >> 4), strict=True):
                wf = (nibbles.astype(x.dtype) * st + ht).reshape(o, -1).astype(xh.dtype)
                y = y + dot_t(xh, wf, out_dtype)
        return y

    return in_blocks(xw, w, chunked, multiply)  # its dtype sizes the blocks


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[T, I] float -> (int8 values, float32 [T, 1] scales): max |x| of each row onto 127."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    inv = jnp.where(scale == 0, 0.0, 1.0 / jnp.where(scale == 0, 1.0, scale))
    return jnp.clip(jnp.rint(x * inv), -127, 127).astype(jnp.int8), scale


def linear_w8a8(x: jax.Array, w, out_dtype) -> jax.Array:
    """int8 rows x per-channel int8 weights, summed exactly in int32, then both scales. Each
    row is quantized on its own, so a row's result does not depend on the rest of the batch.
    One row is padded to W8A8_MIN_ROWS: XLA:CPU's integer matrix-vector product is slower
    than its small matrix product (docs/performance.md)."""
    if not isinstance(w, dict) or w["scale"].shape[-1] != 1 or "min" in w:
        raise ValueError("int8 activations need per-channel int8 weights (--quantization w8a8)")
    rows = x.shape[0]
    xq, xs = quantize_rows(x)
    if rows < W8A8_MIN_ROWS:
        xq = jnp.pad(xq, ((0, W8A8_MIN_ROWS - rows), (0, 0)))
    acc = jax.lax.dot_general(xq, w["q"], (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.int32)[:rows]
    y = acc.astype(jnp.float32) * xs * w["scale"][:, 0].astype(jnp.float32)
    return y.astype(out_dtype)


def chunk_rows(rows: int, row_bytes: int) -> int:
    """The most rows whose dequantized block fits in CHUNK_BYTES, dividing `rows`."""
    fit = max(1, min(rows, CHUNK_BYTES // row_bytes))
    return next(c for c in range(fit, 0, -1) if rows % c == 0)
