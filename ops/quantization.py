"""Weight-only quantization: the formats, quantizing float weights, and the quantized matmul.

A quantized matrix is stored in the [out, in] layout of every float weight (see
models/llama.py) as integer values `q` [..., O, I] with, per group of `group` inputs of
one output row, a float32 scale and optionally a minimum [..., O, I / group]:

    w = q * scale            (symmetric: int8, int4, GGUF Q8_0 and Q4_0)
    w = q * scale + min      (GGUF Q4_1: q in [0, 15])

`group == 0` means one scale per output row (per-channel int8). The GGUF block formats are
exactly this with group 32 and float16 scales, so a Q8_0, Q4_0 or Q4_1 tensor is taken over
value for value (models/gguf_loader.py).

How the matmul runs is chosen per static shape, from measurements on XLA:CPU (2-core Sapphire
Rapids, 30 layers of 576 x 1536, docs/performance.md):
- one row (a lone decode): the dequantization written as an elementwise function of [O, I]
  fuses into XLA's matrix-vector product, which then reads int8 instead of float32 (1.1 ms
  against 2.6 ms for float32 weights in the same layout);
- more rows: per-channel scales are applied to the dot's output (1.1-1.6x faster than
  float32 up to 8 rows, even at 64); group formats are dequantized 64 rows at a time, each
  block multiplied while it is in cache (1.6x faster than float32 at 8 rows, 1.1x at 64;
  dequantizing the whole matrix first is 1.3-1.6x slower than float32, and the elementwise
  form above 3-4x slower).
4-bit values are held one per int8 on CPU: XLA:CPU unpacks packed int4 inside the dot about
9x slower than it converts int8 (measured), so packing would save memory and cost speed.
Other platforms store packed int4 / uint4.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

SCHEMES = ("int8", "int4")  # the --quantization choices (besides none)
INT4_GROUP = 32
CHUNK_ROWS = 64  # rows dequantized at a time at more than one row (64 measured best of 64-512)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    bits: int           # 8 or 4
    group: int          # inputs per scale; 0: one scale per output row
    has_min: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8) or self.group < 0 or (self.has_min and self.bits != 4):
            raise ValueError(f"unsupported quantization format {self}")

    def scale_columns(self, in_features: int) -> int:
        if self.group == 0:
            return 1
        if in_features % self.group:
            raise ValueError(f"input size {in_features} is not a multiple of the "
                             f"quantization group {self.group}")
        return in_features // self.group

    def storage_dtype(self, platform: str | None = None):
        """int8 for 8 bits, and for 4 bits on CPU (see the module docstring)."""
        platform = platform or jax.default_backend()
        if self.bits == 8 or platform == "cpu":
            return jnp.int8
        return jnp.uint4 if self.has_min else jnp.int4

    @property
    def name(self) -> str:
        group = "per-channel" if self.group == 0 else f"group {self.group}"
        return f"int{self.bits} ({group}{', with minimums' if self.has_min else ''})"


def scheme_format(scheme: str) -> QuantFormat:
    """The format a float weight is quantized to under `--quantization scheme`."""
    if scheme == "int8":
        return QuantFormat(8, 0)
    if scheme == "int4":
        return QuantFormat(4, INT4_GROUP)
    raise ValueError(f"unknown quantization {scheme!r}; choose from {', '.join(SCHEMES)}")


def quantize(w, fmt: QuantFormat, *, xp=np) -> dict:
    """A float [..., O, I] weight -> {"q": int8 values, "scale": float32} (symmetric formats),
    with numpy or (under jit, on the device) jax.numpy.

    int8: scale = max|w| / 127 per row (or group). int4: as llama.cpp's Q4_0, the value of
    largest magnitude maps to -8 exactly, scale = that value / -8, q in [-8, 7]."""
    if fmt.has_min:
        raise ValueError("quantizing to a format with minimums is not supported")
    w = xp.asarray(w, xp.float32)
    *lead, rows, cols = w.shape
    g = cols if fmt.group == 0 else fmt.group
    fmt.scale_columns(cols)
    blocks = w.reshape(*lead, rows, cols // g, g)
    if fmt.bits == 8:
        scale = xp.abs(blocks).max(-1) / 127
        lo, hi = -127, 127
    else:
        idx = xp.abs(blocks).argmax(-1)[..., None]
        scale = xp.take_along_axis(blocks, idx, -1)[..., 0] / -8
        lo, hi = -8, 7
    with np.errstate(divide="ignore"):
        inv = xp.where(scale == 0, 0.0, 1.0 / scale)
    q = xp.clip(xp.rint(blocks * inv[..., None]), lo, hi).astype(xp.int8)
    return {"q": q.reshape(w.shape), "scale": scale.astype(xp.float32)}


def dequantize(q, scale, minimum=None, *, xp=jnp, dtype=jnp.float32):
    """[..., O, I] values and [..., O, G] scales (and minimums) -> the float weight."""
    *lead, rows, cols = q.shape
    groups = scale.shape[-1]
    w = q.reshape(*lead, rows, groups, cols // groups).astype(dtype)
    w = w * scale.astype(dtype)[..., None]
    if minimum is not None:
        w = w + minimum.astype(dtype)[..., None]
    return w.reshape(q.shape)


def linear(x: jax.Array, w, out_dtype=None, *, chunked: bool = True) -> jax.Array:
    """x [T, I] @ w [O, I]^T -> [T, O]. `w` is a float array or a dict {"q", "scale"[, "min"]}
    (one layer's slice of a quantized parameter). `out_dtype`: accumulate and return in it
    (float32 logits from bfloat16 activations). `chunked`: dequantize group formats in
    blocks of CHUNK_ROWS rows at more than one row (off where a mesh splits the rows)."""
    dot = lambda a, b: jnp.dot(a, b.T, preferred_element_type=out_dtype)
    if not isinstance(w, dict):
        return dot(x, w)
    q, scale, minimum = w["q"], w["scale"], w.get("min")
    group = q.shape[-1] // scale.shape[-1]
    if group == q.shape[-1] and minimum is None:  # per-channel: scale the output
        y = dot(x, q.astype(x.dtype))
        return y * scale[:, 0].astype(y.dtype)
    if x.shape[0] == 1:  # fused into the matrix-vector product (see the module docstring)
        full = lambda a: jnp.repeat(a.astype(x.dtype), group, axis=-1)
        wf = q.astype(x.dtype) * full(scale)
        if minimum is not None:
            wf = wf + full(minimum)
        return dot(x, wf)
    rows = q.shape[0]
    if not chunked or rows % CHUNK_ROWS:
        return dot(x, dequantize(q, scale, minimum, dtype=x.dtype))
    # Dequantize CHUNK_ROWS rows at a time, each block still in cache when its dot reads it.
    blocks = jax.tree.map(lambda a: a.reshape(rows // CHUNK_ROWS, CHUNK_ROWS, *a.shape[1:]), w)
    ys = jax.lax.map(lambda b: dot(x, dequantize(b["q"], b["scale"], b.get("min"),
                                                 dtype=x.dtype)), blocks)  # [O / C, T, C]
    return ys.transpose(1, 0, 2).reshape(x.shape[0], rows)


def embedding(table, tokens: jax.Array, dtype) -> jax.Array:
    """Rows of a [V, E] float or quantized table -> [T, E] in `dtype`."""
    if not isinstance(table, dict):
        return table[tokens]
    return dequantize(table["q"][tokens], table["scale"][tokens],
                      None if "min" not in table else table["min"][tokens], dtype=dtype)
