"""Weight-only quantization: the formats, quantizing float weights, and the quantized matmul.

A quantized matrix is stored in the [out, in] layout of every float weight (see
models/llama.py) as integer values `q` [..., O, I] with, per group of `group` inputs of
one output row, a scale and optionally a minimum [..., O, I / group]:

    w = q * scale            (symmetric: int8, int4, GGUF Q8_0 and Q4_0)
    w = q * scale + min      (GGUF Q4_1: q in [0, 15])

`group == 0` means one scale per output row (per-channel int8). The GGUF block formats are
exactly this with group 32 and float16 scales, so a Q8_0, Q4_0 or Q4_1 tensor is taken over
value for value (models/gguf_loader.py).

Scales and minimums are float16 (GGUF's own type, so its blocks stay exact; float sources
round their scales to it before quantizing, as llama.cpp does).

How the matmul runs is chosen per static shape, from measurements on XLA:CPU (2-core Sapphire
Rapids, the default model's matrices; docs/performance.md):
- up to NATIVE_MAX_ROWS rows of float32 on one CPU device (any number under
  --batch-invariant, `any_rows`): xlaserve's own kernel (ops/native/qmatmul.cc, an XLA FFI
  custom call built on first use). It converts 8-bit values to float in registers and
  multiplies in float32; 4-bit values run as exact integer dot products with each block of
  32 inputs of a row held as 24-bit integers, float32's precision at the block's largest
  value (weight-only: no 8-bit activation quantization); the output rows are split over
  XLA's intra-op threads. Each row's result is the same sequence of operations whatever the
  other rows are, so a row's numbers do not depend on its batch (XLA's dot gives no such
  promise; at 64 rows and more it is faster, docs/performance.md). XLA's own
  one-row product runs on one thread, and at 2-8 rows XLA materializes the dequantized
  matrix before its dot (30 layers at 2 rows: 8.4 ms against 33.4). A model whose matmuls
  run there (`runs_native`) holds its 4-bit matrices packed two values a byte in
  llama.cpp's Q4 block layout (`pack`): half the memory, and half the bytes a lone decode
  reads (the default model's 30 layers and head at one row: 9.6-11.3 ms against 12.0-12.7
  one value per int8; its weights fit this machine's L3, a larger model's would not). A
  layer of a stacked matrix reaches the kernel as the whole stack and an index
  (`stacked`): XLA copies a slice before a custom call reads it;
- elsewhere, one row: the dequantization written as an elementwise function of [O, I]
  fuses into XLA's matrix-vector product, which then reads int8 instead of float32 (the
  default model's matmuls: 11.6 ms against 29.1 ms for float32 weights);
- more rows: per-channel scales are applied to the dot's output. Group formats are
  dequantized whole when the result fits in CHUNK_BYTES (30 layers of 1536 x 576 at 64 rows:
  16.5 ms against 18.4 ms for float32 weights), else CHUNK_BYTES at a time in a loop, each
  block multiplied while it is in cache (the 49,152-row head at 64 rows: 18 ms, against
  33 ms dequantized whole and 12 ms in float32). Smaller blocks cost more than they save:
  each loop iteration has a fixed cost on XLA:CPU.
w8a8 (opt-in) also quantizes each activation row to int8 (its max |x| onto 127) and runs
the dot integer x integer, summed exactly in int32: XLA:CPU gives that to its integer
matrix kernels, 2.6x faster than the weight-only product at 8 rows, 3x at 64 and 4.7x at 512
(30 layers of the default model's matrices). The price is accuracy: one scale per row is
coarse next to a row's outlier channels, which models/smoothing.py moves into the weights at
load (the default model: teacher-forced agreement 0.90 without it, 0.93-0.94 with it, 0.96
for int8 weights alone). Scales per 64 or 192 inputs were closer (0.95, 0.93 unsmoothed) but
their partial sums cost more than they saved (docs/performance.md).
Without the kernel (no C++ compiler, no AVX-512 VNNI, XLASERVE_NATIVE_KERNELS=0, a mesh, or
bfloat16 activations), 4-bit values are held one per int8 on CPU: XLA:CPU does not fuse the
unpacking of two values from a byte into its matrix-vector product (packed int4, or nibbles
unpacked with shifts and masks, run 9-15x slower than int8 at one row; measured). Other
platforms store packed int4 / uint4.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ops import native

SCHEMES = ("int8", "int4", "w8a8")  # formats a float weight can be quantized to
# --quantization: auto keeps the quantized blocks a GGUF file stores in a format above (and
# leaves the rest in float), none makes every weight float, a scheme quantizes every matrix.
# int8 and int4 are weight-only; w8a8 is int8 per channel with int8 activations (one scale
# per row, computed at each matmul), so the dots run integer x integer.
CHOICES = ("auto", "none", *SCHEMES)
INT4_GROUP = 32
BLOCK = 32  # inputs per block of packed 4-bit values (`pack`)
VOCAB_MATRICES = ("embed", "lm_head")  # one row per token: the embedding table, the LM head
# Under int4, a vocabulary matrix keeps its FREQUENT_ROWS first rows in 8 bits (groups of 32,
# as llama.cpp's Q8_0) and holds the rest, parameter `name + RARE`, in int4. Tokenizers list
# their tokens most frequent first (BPE in merge order, SentencePiece by score), so the head's
# error falls on tokens rarely predicted. The default model's tied head (49,152 rows), its
# other rows Q4_1-like: top-1 agreement 0.970 teacher-forced against the 8-bit head (8,192
# rows: 0.981; every row in 4 bits: 0.897), 5.3 bits a weight against 8.5, the whole model
# 15.8% of float32's bytes (8,192 rows: 16.0%; docs/performance.md).
FREQUENT_ROWS = 4096
RARE = "_rare"
NATIVE_MAX_ROWS = 8  # the most rows ops/native's kernel takes, unless `any_rows` (below)
CHUNK_BYTES = 4 << 20  # the largest dequantized block at more than one row (measured: 0.25-16 MiB)
SCALE_DTYPE = np.float16
W8A8_MIN_ROWS = 2  # an int8 x int8 product of one row runs padded to this many
NATIVE_MAX_MATRICES = 4  # the most matrices one call of it multiplies the same rows by


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    bits: int           # 8 or 4
    group: int          # inputs per scale; 0: one scale per output row
    has_min: bool = False
    activations: int = 0  # 0: the matmul reads activations in the compute dtype; 8: int8
    packed: bool = False  # 4 bits: two values a byte, uint8 [..., O, I / 2] (`pack`)

    def __post_init__(self):
        if (self.bits not in (4, 8) or self.group < 0 or (self.has_min and self.bits != 4)
                or self.activations not in (0, 8)
                or (self.activations and (self.bits, self.group) != (8, 0))
                or (self.packed and (self.bits != 4 or self.group % BLOCK))):
            raise ValueError(f"unsupported quantization format {self}")

    def scale_columns(self, in_features: int) -> int:
        if self.group == 0:
            return 1
        if in_features % self.group:
            raise ValueError(f"input size {in_features} is not a multiple of the "
                             f"quantization group {self.group}")
        return in_features // self.group

    def storage_dtype(self, platform: str | None = None):
        """int8 for 8 bits, and for 4 bits on CPU unless packed for the CPU kernel (see the
        module docstring)."""
        platform = platform or jax.default_backend()
        if self.packed:
            return jnp.uint8
        if self.bits == 8 or platform == "cpu":
            return jnp.int8
        return jnp.uint4 if self.has_min else jnp.int4

    def storage_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The values' array shape for a [..., O, I] matrix."""
        return (*shape[:-1], shape[-1] // 2) if self.packed else tuple(shape)

    @property
    def name(self) -> str:
        group = "per-channel" if self.group == 0 else f"group {self.group}"
        extra = ", with minimums" if self.has_min else ""
        extra += ", int8 activations" if self.activations else ""
        return f"int{self.bits} ({group}{extra})"


def scheme_format(scheme: str, name: str = "") -> QuantFormat:
    """The format float weight `name` is quantized to under `--quantization scheme`."""
    if scheme == "int4" and name in VOCAB_MATRICES:  # its frequent rows (`split_rows`)
        return QuantFormat(8, INT4_GROUP)
    if scheme == "int8":
        return QuantFormat(8, 0)
    if scheme == "w8a8":
        return QuantFormat(8, 0, activations=8)
    if scheme == "int4":
        return QuantFormat(4, INT4_GROUP, has_min=True)
    raise ValueError(f"unknown quantization {scheme!r}; choose from {', '.join(SCHEMES)}")


def quantize(w, fmt: QuantFormat, *, xp=np) -> dict:
    """A float [..., O, I] weight -> {"q": int8 values, "scale": float16[, "min": float16]},
    with numpy or (under jit, on the device) jax.numpy.

    int8: scale = max|w| / 127 per row (or group). int4: as llama.cpp's Q4_0, the value of
    largest magnitude maps to -8 exactly, scale = that value / -8, q in [-8, 7]. int4 with
    minimums: as Q4_1, min = the group's minimum, scale = its range / 15, q in [0, 15]."""
    w = xp.asarray(w, xp.float32)
    *lead, rows, cols = w.shape
    g = cols if fmt.group == 0 else fmt.group
    fmt.scale_columns(cols)
    blocks = w.reshape(*lead, rows, cols // g, g)
    parts = {}
    if fmt.has_min:  # as llama.cpp's Q4_1: the group's range onto [0, 15]
        parts["min"] = blocks.min(-1).astype(SCALE_DTYPE)
        blocks = blocks - parts["min"].astype(xp.float32)[..., None]
        scale, lo, hi = blocks.max(-1) / 15, 0, 15
    elif fmt.bits == 8:
        scale, lo, hi = xp.abs(blocks).max(-1) / 127, -127, 127
    else:
        idx = xp.abs(blocks).argmax(-1)[..., None]
        scale, lo, hi = xp.take_along_axis(blocks, idx, -1)[..., 0] / -8, -8, 7
    scale = scale.astype(SCALE_DTYPE)  # the values are rounded against the stored scale
    with np.errstate(divide="ignore"):
        inv = xp.where(scale == 0, 0.0, 1.0 / scale.astype(xp.float32))
    q = xp.clip(xp.rint(blocks * inv[..., None]), lo, hi).astype(xp.int8)
    return {"q": q.reshape(w.shape), "scale": scale, **parts}


def pack(q, symmetric: bool, *, xp=np):
    """4-bit values int8 [..., O, I] -> uint8 [..., O, I / 2], llama.cpp's Q4 block layout:
    in each block of 32 inputs, byte j holds input j in its low nibble and input j + 16 in
    its high one. Symmetric values ([-8, 7]) are stored plus 8, as Q4_0 stores them."""
    *lead, rows, cols = q.shape
    blocks = q.reshape(*lead, rows, cols // BLOCK, 2, BLOCK // 2).astype(xp.int32)
    if symmetric:
        blocks = blocks + 8
    return (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).astype(xp.uint8).reshape(
        *lead, rows, cols // 2)


def unpack(q, symmetric: bool, *, xp=jnp):
    """`pack`'s inverse: uint8 [..., O, I / 2] -> int8 values [..., O, I]."""
    *lead, rows, half = q.shape
    blocks = q.reshape(*lead, rows, half // (BLOCK // 2), BLOCK // 2)
    values = xp.concatenate([blocks & 15, blocks >> 4], axis=-1).astype(xp.int8)
    return (values - 8 if symmetric else values).reshape(*lead, rows, 2 * half)


def dequantize(q, scale, minimum=None, *, xp=jnp, dtype=jnp.float32):
    """[..., O, I] values (or packed, uint8 [..., O, I / 2]) and [..., O, G] scales (and
    minimums) -> the float weight."""
    if q.dtype == xp.uint8:
        q = unpack(q, minimum is None, xp=xp)
    *lead, rows, cols = q.shape
    groups = scale.shape[-1]
    w = q.reshape(*lead, rows, groups, cols // groups).astype(dtype)
    w = w * scale.astype(dtype)[..., None]
    if minimum is not None:
        w = w + minimum.astype(dtype)[..., None]
    return w.reshape(q.shape)


def linear(x: jax.Array, w, out_dtype=None, *, chunked: bool = True,
           int8_activations: bool = False, native: bool = False,
           any_rows: bool = False) -> jax.Array:
    """x [T, I] @ w [O, I]^T -> [T, O]. `w` is a float array or a dict {"q", "scale"[, "min"]}:
    one layer's slice of a quantized parameter, or the whole stack [L, O, I] with its
    "layer" index (`stacked`). `out_dtype`: accumulate and return in it (float32 logits
    from bfloat16 activations). `chunked`: dequantize group formats in blocks of at most
    CHUNK_BYTES at more than one row (off where a mesh splits the rows).
    `int8_activations`: `w` is per-channel int8 and `x` is quantized to int8 per row (w8a8).
    `native`: run xlaserve's CPU kernel where it serves (`native_fits`); `any_rows`: at any
    number of rows (--batch-invariant), not only up to NATIVE_MAX_ROWS."""
    dot = lambda a, b: jnp.dot(a, b.T, preferred_element_type=out_dtype)
    if native and native_fits(x, w, any_rows):
        y = native_linear(x, w)
        return y if out_dtype is None else y.astype(out_dtype)
    if isinstance(w, dict) and "layer" in w:
        w = {k: jax.lax.dynamic_index_in_dim(a, w["layer"], 0, False)
             for k, a in w.items() if k != "layer"}
    if int8_activations:
        return _linear_w8a8(x, w, out_dtype or x.dtype)
    if not isinstance(w, dict):
        return dot(x, w)
    q, scale, minimum = w["q"], w["scale"], w.get("min")
    group = x.shape[-1] // scale.shape[-1]
    if q.dtype == jnp.uint8:  # packed 4 bits (the CPU kernel's rows are above)
        return _packed_linear(x, w, out_dtype, chunked)
    if group == x.shape[-1] and minimum is None:  # per-channel: scale the output
        if x.shape[0] == 1 and reduces_one_row():
            return channel_sums(x, q, scale, out_dtype)
        y = dot(x, q.astype(x.dtype))
        return y * scale[:, 0].astype(y.dtype)
    if x.shape[0] == 1:  # fused into the matrix-vector product (see the module docstring)
        full = lambda a: jnp.repeat(a.astype(x.dtype), group, axis=-1)
        wf = q.astype(x.dtype) * full(scale)
        if minimum is not None:
            wf = wf + full(minimum)
        return dot(x, wf)
    return _in_blocks(x, w, chunked, lambda x, b: dot(
        x, dequantize(b["q"], b["scale"], b.get("min"), dtype=x.dtype)))


def reduces_one_row() -> bool:
    """Whether `linear` runs one row of per-channel int8 as `channel_sums` (on a GPU)."""
    return jax.default_backend() == "gpu"


def channel_sums(x: jax.Array, q: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """x [T, I] times per-channel int8 q [O, I] (scale [O, 1]) as a multiply and a sum over
    the inputs in float32, not a dot: XLA fuses the conversion into one pass over the int8
    values. A GPU runs one row so (an H200, 4096 x 14336: 0.031-0.048 against the dot's
    0.100-0.147 ms; ops.bench_quantization); at 64 rows it was 10x slower than the dot."""
    y = (x.astype(jnp.float32)[:, None, :] * q.astype(jnp.float32)[None]).sum(-1)
    return (y * scale[:, 0].astype(jnp.float32)).astype(out_dtype or x.dtype)


def held_bytes(a) -> int:
    """Bytes the device holds for array `a`: 4-bit dtypes are packed two a byte there, though
    jax's `nbytes` counts one each."""
    return a.size // 2 if a.dtype in (jnp.int4, jnp.uint4) else a.nbytes


def _in_blocks(x: jax.Array, w: dict, chunked: bool, product) -> jax.Array:
    """`product(x, w)` [T, O], over blocks of w's rows that dequantize to at most
    CHUNK_BYTES when `chunked`, each block still in cache when its dot reads it."""
    rows = w["q"].shape[0]
    chunk = chunk_rows(rows, x.shape[-1] * jnp.dtype(x.dtype).itemsize) if chunked else rows
    if chunk == rows:
        return product(x, w)
    blocks = jax.tree.map(lambda a: a.reshape(rows // chunk, chunk, *a.shape[1:]), w)
    ys = jax.lax.map(lambda b: product(x, b), blocks)  # [O / C, T, C]
    return ys.transpose(1, 0, 2).reshape(x.shape[0], rows)


def _packed_linear(x: jax.Array, w: dict, out_dtype, chunked: bool) -> jax.Array:
    """XLA's product with packed 4-bit values: the low and the high nibbles each dequantize
    elementwise to [O, I / 2] and meet the inputs they hold (the first and the last 16 of
    each block of 32), two dots summed. Interleaving the nibbles back into [O, I] first ran
    2-3x slower at 16-64 rows (30 layers at 64 rows: 73.5 ms this way, 156.4 interleaved,
    66.3 one value per int8; measured)."""
    rows_x, cols = x.shape
    halves = x.reshape(rows_x, cols // BLOCK, 2, BLOCK // 2)
    x_lo, x_hi = (halves[:, :, h].reshape(rows_x, cols // 2) for h in (0, 1))
    symmetric = "min" not in w

    def product(_, b):
        q, scale, minimum = b["q"], b["scale"], b.get("min")
        per_group = cols // (scale.shape[-1] * BLOCK)  # blocks a scale covers
        o = q.shape[0]
        scale = jnp.repeat(scale.astype(x.dtype), per_group, axis=-1)[..., None]
        shift = (-8 * scale if symmetric else
                 jnp.repeat(minimum.astype(x.dtype), per_group, axis=-1)[..., None])
        y = 0
        for xh, nibbles in ((x_lo, q & 15), (x_hi, q >> 4)):
            wf = nibbles.reshape(o, cols // BLOCK, BLOCK // 2).astype(x.dtype) * scale + shift
            y = y + jnp.dot(xh, wf.reshape(o, cols // 2).T, preferred_element_type=out_dtype)
        return y

    return _in_blocks(x, w, chunked, product)


def stacked(w: dict, layer) -> dict:
    """Layer `layer` of a stacked quantized matrix as `linear` takes it, unsliced: a slice
    handed to the CPU kernel (a custom call) would be copied first, 4.4 ms a token for
    the default model's 30 layers (measured). `linear` slices it where XLA runs."""
    return {**w, "layer": layer}


def runs_native(dtype, quant: dict, *, sharded: bool) -> bool:
    """Whether a model's quantized matmuls of a few rows run in ops/native's kernel: float32
    activations, weight-only formats, one CPU device (XLA splits the matmuls under a
    mesh), and a kernel that could be built here. Such a model also holds its 4-bit
    matrices packed (`packed_formats`)."""
    return bool(quant and not sharded and jnp.dtype(dtype) == jnp.float32
                and not any(fmt.activations for fmt in quant.values())
                and jax.default_backend() == "cpu" and native.available())


def packed_formats(quant: dict) -> dict:
    """`quant` with its 4-bit group formats packed two values a byte (see the module
    docstring). XLA's own one-row product would unpack them 9-15x slower than it reads one
    value per int8, so only a model that `runs_native` packs them."""
    return {name: dataclasses.replace(fmt, packed=True)
            if fmt.bits == 4 and fmt.group and fmt.group % BLOCK == 0 else fmt
            for name, fmt in quant.items()}


def native_fits(x: jax.Array, w, any_rows: bool = False) -> bool:
    """Whether ops/native's kernel takes this product: float32 rows (up to NATIVE_MAX_ROWS
    of them, or any number with `any_rows`), and a matrix of one-per-int8 values with
    float16 scales per
    group of a multiple of 16 inputs (every format of SCHEMES but w8a8's, and GGUF's), or
    of packed values with groups of 32 times a power of two."""
    if (not isinstance(w, dict) or x.dtype != jnp.float32 or x.ndim != 2
            or x.shape[0] < 1 or (x.shape[0] > NATIVE_MAX_ROWS and not any_rows)):
        return False
    q, scale = w["q"], w["scale"]
    packed = q.dtype == jnp.uint8
    groups, cols = scale.shape[-1], q.shape[-1] * (2 if packed else 1)
    return ((packed or q.dtype == jnp.int8) and scale.dtype == jnp.float16
            and cols == x.shape[1] and cols % groups == 0
            and (cols // groups) % (BLOCK if packed else 16) == 0 and groups <= 1024
            and not (packed and (cols // groups // BLOCK) & (cols // groups // BLOCK - 1))
            and q.ndim == (3 if "layer" in w else 2) and native.available())


def native_linear(x: jax.Array, w: dict) -> jax.Array:
    """x [T, I] float32 @ w^T -> [T, O] float32 through ops/native/qmatmul.cc."""
    return native_linears(x, [w])[0]


def native_linears(x: jax.Array, ws: list[dict]) -> list[jax.Array]:
    """x times each of up to 4 matrices (one layer index for all), in one call of
    ops/native/qmatmul.cc: their rows are split over the threads together."""
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
    return list(call(x, jnp.asarray(0 if layer is None else layer, jnp.int32), *operands))


def linears(x: jax.Array, ws: list, *, native: bool = False, **kwargs) -> list[jax.Array]:
    """`linear(x, w, ...)` for each of `ws` (same rows x): one native call for all where the
    kernel takes every one of them (q, k and v; gate and up), else one product each."""
    any_rows = kwargs.get("any_rows", False)
    if (native and 1 < len(ws) <= NATIVE_MAX_MATRICES
            and all(native_fits(x, w, any_rows) for w in ws)):
        return native_linears(x, ws)
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


def frequent_rows(vocab: int) -> int | None:
    """Where an int4 vocabulary matrix of `vocab` rows splits (see FREQUENT_ROWS); None: it
    is too small to split."""
    return FREQUENT_ROWS if vocab > FREQUENT_ROWS else None


def split_rows(w, rows: int) -> tuple:
    """A [V, E] float matrix, or its quantized parts, -> (its first `rows` rows, the rest)."""
    if isinstance(w, dict):
        return tuple({k: v[sl] for k, v in w.items()} for sl in (slice(rows), slice(rows, None)))
    return w[:rows], w[rows:]


def rows_of(w) -> int:
    return (w["q"] if isinstance(w, dict) else w).shape[0]


def vocab_linear(x: jax.Array, blocks: tuple, **kwargs) -> jax.Array:
    """x [T, I] times a vocabulary matrix held as row blocks (float or quantized, as `linear`
    takes them; the first rows first) -> [T, V] float32 logits: one product per block (one
    kernel call for all where ops/native's kernel takes them), joined."""
    ys = linears(x, list(blocks), out_dtype=jnp.float32, **kwargs)
    return ys[0] if len(ys) == 1 else jnp.concatenate(ys, -1)


def embedding(table, tokens: jax.Array, dtype) -> jax.Array:
    """Rows of a [V, E] float or quantized table, or of such a table held as row blocks (a
    tuple, the first rows first), -> [T, E] in `dtype`."""
    if isinstance(table, tuple):
        out, start = None, 0
        for block in table:
            rows = rows_of(block)
            x = embedding(block, jnp.clip(tokens - start, 0, rows - 1), dtype)
            out = x if out is None else jnp.where((tokens >= start)[:, None], x, out)
            start += rows
        return out
    if not isinstance(table, dict):
        return table[tokens]
    return dequantize(table["q"][tokens], table["scale"][tokens],
                      None if "min" not in table else table["min"][tokens], dtype=dtype)
