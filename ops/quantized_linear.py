"""The quantized matmul, `linear`: x times a float or quantized [out, in] weight (the formats
of ops/quantization.py), in a form chosen per static shape from measurements on XLA:CPU
(docs/performance.md):

- up to NATIVE_MAX_ROWS rows of float32 on one CPU device (any number under
  --batch-invariant, `any_rows`): xlaserve's own kernel (ops/native/qmatmul.cc, an XLA FFI
  custom call built on first use). It converts 8-bit values to float in registers and
  multiplies in float32; 4-bit values run as exact integer dot products with each block of
  32 inputs of a row held as 24-bit integers, float32's precision at the block's largest
  value (`x_bits` 24), or as 8-bit ones (`x_bits` 8, --cpu-activation-dtype int8: a third
  of the dot products, llama.cpp's Q8 activations' precision); the output rows are split over
  XLA's intra-op threads. Each row's result is the same sequence of operations whatever the
  other rows are, so a row's numbers do not depend on its batch (XLA's dot gives no such
  promise; at many rows it is faster). XLA's own one-row product runs on one thread, and at
  a few rows XLA materializes the dequantized matrix before its dot. A model whose matmuls
  run there (`runs_native`) holds its 4-bit matrices packed two values a byte (`pack`), in
  the order the kernel reads them (`held_formats`): half the memory, and half the bytes a
  lone decode reads. A layer of a stacked matrix reaches the kernel as the whole stack and an index
  (`stacked`): XLA copies a slice before a custom call reads it ("A CPU kernel for
  quantized matmuls, and 4-bit weights two a byte");
- on a GPU, float and per-channel int8 weights at one row: a multiply and a sum
  (`row_sums`), which XLA fuses with the layer's slice and the dequantization, reading the
  stored values in place; a layer of a stack handed whole (`stacked`: float and int8 from 2
  rows, group formats and packed 4-bit values at any row count up to
  ops/pallas_gpu_matmul.MAX_ROWS) and the int4 head's row blocks: ops/pallas_gpu_matmul, which
  reads the stack in place and dequantizes in registers;
- elsewhere, one row: the dequantization written as an elementwise function of [O, I]
  fuses into XLA's matrix-vector product, which then reads int8 instead of float32;
- more rows: per-channel scales are applied to the dot's output. Group formats are
  dequantized whole when the result fits in CHUNK_BYTES, else CHUNK_BYTES at a time in a
  loop, each block multiplied while it is in cache. Smaller blocks cost more than they save:
  each loop iteration has a fixed cost on XLA:CPU ("The default server runs its file's
  4-bit weights").

w8a8 (opt-in) also quantizes each activation row to int8 (its max |x| onto 127) and runs
the dot integer x integer, summed exactly in int32: XLA:CPU gives that to its integer
matrix kernels, several times faster than the weight-only product from a few rows up. The
price is accuracy: one scale per row is coarse next to a row's outlier channels, which
models/smoothing.py moves into the weights at load. Scales per block of inputs were closer
but their partial sums cost more than they saved ("int8 activations: `--quantization
w8a8`").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ops import native, pallas_gpu_matmul
from ops.quantization import BLOCK, LANE_BLOCKS, dequantize, to_lanes

NATIVE_MAX_ROWS = 8  # the most rows ops/native's kernel takes, unless `any_rows` (below)
# The largest dequantized block at more than one row (the fastest size measured,
# docs/performance.md).
CHUNK_BYTES = 4 << 20
W8A8_MIN_ROWS = 2  # an int8 x int8 product of one row runs padded to this many
NATIVE_MAX_MATRICES = 4  # the most matrices one call of it multiplies the same rows by
# --cpu-activation-dtype: the bits each input of x keeps in ops/native's products with packed
# 4-bit weights (per block of 32, scaled to the block's largest |x|)
X_BITS = {"float32": 24, "int8": 8}
FULL_X_BITS = X_BITS["float32"]  # the default: float32's precision at each block's largest |x|


def linear(x: jax.Array, w, out_dtype=None, *, chunked: bool = True,
           int8_activations: bool = False, native: bool = False,
           any_rows: bool = False, wide_dtype=None, x_bits: int = FULL_X_BITS,
           lanes: bool = False) -> jax.Array:
    """x [T, I] @ w [O, I]^T -> [T, O]. `w` is a float array or a dict {"q", "scale"[, "min"]}:
    one layer's slice of a quantized parameter, or the whole stack [L, O, I] with its
    "layer" index (`stacked`). `out_dtype`: accumulate and return in it (float32 logits
    from bfloat16 activations). `chunked`: dequantize group formats in blocks of at most
    CHUNK_BYTES at more than one row (off where a mesh splits the rows).
    `int8_activations`: `w` is per-channel int8 and `x` is quantized to int8 per row (w8a8).
    `native`: run xlaserve's CPU kernel where it serves (`native_fits`); `any_rows`: at any
    number of rows (--batch-invariant), not only up to NATIVE_MAX_ROWS. `wide_dtype`: the
    dtype XLA's products of more than NATIVE_MAX_ROWS rows multiply in (`wide_dtype`, the
    function), summed in `out_dtype` or x's. `x_bits`: the bits x keeps per block of 32 in
    ops/native's products with packed 4-bit values (X_BITS). `lanes`: packed 4-bit values
    are in the order ops/native's kernel reads (ops/quantization.to_lanes), the only order
    it takes them in (`held_formats`)."""
    out = out_dtype or x.dtype
    wide = wide_dtype if wide_dtype is not None and x.shape[0] > NATIVE_MAX_ROWS else None
    dot = functools.partial(_dot_t, out_dtype=out)
    if isinstance(w, dict) and not native and not int8_activations and not lanes:
        y = _stacked_kernel(x, w, out_dtype)  # (it reads packed values in `pack`'s order)
        if y is not None:
            return y
    if native and native_fits(x, w, any_rows, lanes):
        y = native_linear(x, w, x_bits)
        return y if out_dtype is None else y.astype(out_dtype)
    if isinstance(w, dict) and "layer" in w:
        w = {k: jax.lax.dynamic_index_in_dim(a, w["layer"], 0, False)
             for k, a in w.items() if k != "layer"}
        w = w.get("stack", w)  # a float matrix's slice
    if int8_activations:
        return _linear_w8a8(x, w, out_dtype or x.dtype)
    if x.shape[0] == 1 and reduces_one_row():
        return row_sums(x, w, out_dtype)
    if not isinstance(w, dict):
        return dot(x, w) if wide is None else dot(x.astype(wide), w.astype(wide))
    q, scale, minimum = w["q"], w["scale"], w.get("min")
    group = x.shape[-1] // scale.shape[-1]
    if q.dtype == jnp.uint8:  # packed 4 bits (the CPU kernel's rows are above)
        return _packed_linear(x, w, out, chunked, wide, lanes)
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
    return _in_blocks(x.astype(wide or x.dtype), w, chunked, lambda xw, b: dot(
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


def _dot_t(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    """x [T, I] @ w [O, I]^T, contracting the inputs of both in place: XLA:CPU ran a bfloat16
    `x @ w.T` (a transpose, then a dot) at a sixth of this one's rate (229 against 1,374
    GFLOP/s at 512 x 1536 x 8960, a 2-vCPU Sapphire Rapids)."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def _kernel_operands(x: jax.Array, w: dict) -> tuple[dict, object] | None:
    """`w` as ops/pallas_gpu_matmul takes it ({"stack", "scale", "min"} and the layer index)
    where `linear` hands it there, else None: a layer handed whole with its index
    (`stacked`), float or per-channel int8 from 2 rows (one row: `row_sums` reads those in
    place) and group formats at any row count; and on a GPU a group-format matrix outside
    the stack (the LM head's row blocks under int4) as a stack of one. XLA's products of
    4-bit values read 0.02-0.13 of the copy rate on an H200 (ops/pallas_gpu_matmul)."""
    scale, minimum = w.get("scale"), w.get("min")
    group = scale is not None and scale.shape[-1] > 1
    if "layer" in w:
        stack, layer = w.get("stack", w.get("q")), w["layer"]
    elif group and jax.default_backend() == "gpu":
        stack, layer, scale = w["q"][None], 0, scale[None]
        minimum = None if minimum is None else minimum[None]
    else:
        return None
    if (x.shape[0] == 1 and not group) or not pallas_gpu_matmul.fits(x, stack, scale, minimum):
        return None
    mat = {"stack": stack, "scale": scale, "min": minimum}
    return {k: v for k, v in mat.items() if v is not None}, layer


def _stacked_kernel(x: jax.Array, w: dict, out_dtype) -> jax.Array | None:
    """ops/pallas_gpu_matmul's product where it takes `w` (`_kernel_operands`), else None."""
    found = _kernel_operands(x, w)
    if found is None:
        return None
    return pallas_gpu_matmul.stacked_matmuls(x, [found[0]], found[1], out_dtype)[0]


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


def _in_blocks(x: jax.Array, w: dict, chunked: bool, product) -> jax.Array:
    """`product(x, w)` [T, O], over blocks of w's rows that dequantize to at most
    CHUNK_BYTES when `chunked`, each block still in cache when its dot reads it."""
    rows = w["q"].shape[0]
    chunked = chunked and jax.default_backend() == "cpu"  # a CPU's caches; a GPU: one dot
    chunk = chunk_rows(rows, x.shape[-1] * jnp.dtype(x.dtype).itemsize) if chunked else rows
    if chunk == rows:
        return product(x, w)
    blocks = jax.tree.map(lambda a: a.reshape(rows // chunk, chunk, *a.shape[1:]), w)
    ys = jax.lax.map(lambda b: product(x, b), blocks)  # [O / C, T, C]
    return ys.transpose(1, 0, 2).reshape(x.shape[0], rows)


def _packed_linear(x: jax.Array, w: dict, out_dtype, chunked: bool, wide=None,
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

    def product(_, b):
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
                y = y + _dot_t(xh, wf, out_dtype)
        if whole < blocks:
            qt = q[:, whole * BLOCK // 2:].reshape(o, blocks - whole, BLOCK // 2)
            st, ht = scale[:, whole:, None], shift[:, whole:, None]
            for xh, nibbles in zip(xt, (qt & 15, qt >> 4), strict=True):
                wf = (nibbles.astype(x.dtype) * st + ht).reshape(o, -1).astype(xh.dtype)
                y = y + _dot_t(xh, wf, out_dtype)
        return y

    return _in_blocks(xw, w, chunked, product)  # its dtype sizes the blocks


def stacked(w, layer) -> dict:
    """Layer `layer` of a stacked matrix as `linear` takes it, unsliced: a quantized one for
    the CPU kernel (a slice handed to a custom call would be copied first, a cost measured
    in docs/performance-log.md, "A CPU kernel for quantized matmuls, and 4-bit weights two a
    byte"), a float one ({"stack", "layer"}) or a per-channel int8 one for
    ops/pallas_gpu_matmul from 2 rows up. `linear` slices it where XLA runs."""
    if isinstance(w, dict):
        return {**w, "layer": layer}
    return {"stack": w, "layer": layer}


def runs_native(dtype, quant: dict, *, sharded: bool) -> bool:
    """Whether a model's quantized matmuls of a few rows run in ops/native's kernel: float32
    activations, weight-only formats, one CPU device (XLA splits the matmuls under a
    mesh), and a kernel that could be built here. Such a model also holds its 4-bit
    matrices packed (`held_formats`)."""
    return bool(quant and not sharded and jnp.dtype(dtype) == jnp.float32
                and not any(fmt.activations for fmt in quant.values())
                and jax.default_backend() == "cpu" and native.available("qmatmul"))


def holds_packed(dtype, quant: dict, *, sharded: bool) -> bool:
    """Whether a model holds its 4-bit group matrices packed two values a byte
    (`held_formats`): where ops/native's kernel runs its matmuls (`runs_native`), and on one
    GPU, where ops/pallas_gpu_matmul unpacks them in its read. XLA:CPU's own one-row product
    would unpack them many times slower than it reads one value per int8."""
    if runs_native(dtype, quant, sharded=sharded):
        return True
    return bool(quant and not sharded and jax.default_backend() == "gpu"
                and not any(fmt.activations for fmt in quant.values()))


def held_formats(dtype, quant: dict, *, sharded: bool) -> dict:
    """`quant` as a model of `dtype` holds it here: where it `holds_packed`, its 4-bit group
    formats packed two values a byte (see ops/quantization.py's docstring), in the order
    ops/native's kernel reads (`lanes`: ops/quantization.to_lanes) where that kernel runs
    them, which then need no reordering as each token reads them (a lone decode's products
    took ~0.85x the time on AVX2: docs/performance-log.md, "4-bit weights held in the
    kernel's order")."""
    if not holds_packed(dtype, quant, sharded=sharded):
        return dict(quant)
    lanes = runs_native(dtype, quant, sharded=sharded)
    return {name: dataclasses.replace(fmt, packed=True, lanes=lanes)
            if fmt.bits == 4 and fmt.group and fmt.group % BLOCK == 0 else fmt
            for name, fmt in quant.items()}


def native_fits(x: jax.Array, w, any_rows: bool = False, lanes: bool = False) -> bool:
    """Whether ops/native's kernel takes this product: float32 rows (up to NATIVE_MAX_ROWS
    of them, or any number with `any_rows`), and a matrix of one-per-int8 values with
    float16 scales per group of a multiple of 16 inputs (every format of SCHEMES but
    w8a8's, and GGUF's), or of packed values in its order (`lanes`) with groups of 32 times
    a power of two."""
    if (not isinstance(w, dict) or x.dtype != jnp.float32 or x.ndim != 2
            or x.shape[0] < 1 or (x.shape[0] > NATIVE_MAX_ROWS and not any_rows)):
        return False
    q, scale = w["q"], w["scale"]
    packed = q.dtype == jnp.uint8
    groups, cols = scale.shape[-1], q.shape[-1] * (2 if packed else 1)
    return (((packed and lanes) or q.dtype == jnp.int8) and scale.dtype == jnp.float16
            and cols == x.shape[1] and cols % groups == 0
            and (cols // groups) % (BLOCK if packed else 16) == 0 and groups <= 1024
            and not (packed and (cols // groups // BLOCK) & (cols // groups // BLOCK - 1))
            and q.ndim == (3 if "layer" in w else 2) and native.available("qmatmul"))


def native_linear(x: jax.Array, w: dict, x_bits: int = FULL_X_BITS) -> jax.Array:
    """x [T, I] float32 @ w^T -> [T, O] float32 through ops/native/qmatmul.cc."""
    return native_linears(x, [w], x_bits)[0]


def native_linears(x: jax.Array, ws: list[dict], x_bits: int = FULL_X_BITS) -> list[jax.Array]:
    """x times each of up to 4 matrices (one layer index for all), in one call of
    ops/native/qmatmul.cc: their rows are split over the threads together. `x_bits` (24 or
    8): the bits x keeps per block of 32 where a matrix is packed 4-bit (X_BITS)."""
    if x_bits not in X_BITS.values():
        raise ValueError(f"x_bits must be 24 or 8, got {x_bits!r}")
    layer = ws[0].get("layer")
    if any(w.get("layer") is not layer for w in ws):
        raise ValueError("matrices in one native call share one layer index")
    operands = []
    for w in ws:
        q, scale, minimum = w["q"], w["scale"], w.get("min")
        if layer is None:  # a matrix outside the stack (the LM head): a stack of one
            q, scale = q[None], scale[None]
            minimum = None if minimum is None else minimum[None]
        operands += [q, scale, jnp.zeros((0,), jnp.float16) if minimum is None else minimum]
    call = jax.ffi.ffi_call(native.QMATMUL, [
        jax.ShapeDtypeStruct((x.shape[0], w["q"].shape[-2]), jnp.float32) for w in ws])
    return list(call(x, jnp.asarray(0 if layer is None else layer, jnp.int32), *operands,
                     x_bits=np.int32(x_bits)))


def linears(x: jax.Array, ws: list, *, native: bool = False, **kwargs) -> list[jax.Array]:
    """`linear(x, w, ...)` for each of `ws` (same rows x): one native call for all where the
    CPU kernel takes every one of them (q, k and v; gate and up), one call of
    ops/pallas_gpu_matmul where it takes each and they are alike, else one product each."""
    any_rows = kwargs.get("any_rows", False)
    if (native and 1 < len(ws) <= NATIVE_MAX_MATRICES
            and all(native_fits(x, w, any_rows, kwargs.get("lanes", False)) for w in ws)):
        return native_linears(x, ws, kwargs.get("x_bits", FULL_X_BITS))
    if (not native and not kwargs.get("int8_activations") and not kwargs.get("lanes")
            and len(ws) > 1):
        # one ops/pallas_gpu_matmul kernel for all where it takes each, alike, of one layer
        found = [_kernel_operands(x, w) if isinstance(w, dict) else None for w in ws]
        if (all(f is not None and f[1] is found[0][1] for f in found)
                and pallas_gpu_matmul.alike(x, [f[0] for f in found])):
            return pallas_gpu_matmul.stacked_matmuls(x, [f[0] for f in found], found[0][1],
                                                     kwargs.get("out_dtype"))
    return [linear(x, w, native=native, **kwargs) for w in ws]


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[T, I] float -> (int8 values, float32 [T, 1] scales): max |x| of each row onto 127."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    inv = jnp.where(scale == 0, 0.0, 1.0 / jnp.where(scale == 0, 1.0, scale))
    return jnp.clip(jnp.rint(x * inv), -127, 127).astype(jnp.int8), scale


def _linear_w8a8(x: jax.Array, w, out_dtype) -> jax.Array:
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

