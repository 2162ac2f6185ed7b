"""Weight quantization: the formats, quantizing float weights, and 4-bit packing.

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

Where xlaserve's CPU kernel runs a model's matmuls (ops/cpu_linear.py `runs_native`),
its 4-bit matrices are packed two values a byte (`pack`), each whole group of 16 blocks in
the order the kernel reads (`to_lanes`); on CPUs whose kernel multiplies bytes
(ops/native.multiplies_bytes), its 8-bit matrices in groups of 32 are held plus 128 as uint8,
in the same order (`to_lanes8`). Without the kernel (no C++
compiler, a failed build, --cpu-kernels none, a mesh, or bfloat16 activations),
4-bit values are held one per int8 on CPU: XLA:CPU does not fuse the unpacking of two values
from a byte into its matrix-vector product, and packed int4, or nibbles unpacked with shifts
and masks, ran many times slower than int8 at one row (docs/performance-log.md, "The default
server runs its file's 4-bit weights"). Other platforms store packed int4 / uint4.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

SCHEMES = ("int8", "int4", "w8a8")  # formats a float weight can be quantized to
# --quantization: auto keeps the quantized blocks a GGUF file stores in a format above (and
# leaves the rest in float), none makes every weight float, a scheme quantizes every matrix.
# int8 and int4 are weight-only; w8a8 is int8 per channel with int8 activations (one scale
# per row, computed at each matmul), so the dots run integer x integer.
CHOICES = ("auto", "none", *SCHEMES)
INT4_GROUP = 32
BLOCK = 32  # inputs per block of packed 4-bit values (`pack`)
LANE_BLOCKS = 16  # blocks of packed values `to_lanes` reorders as one group (256 bytes)
# One row per token: the embedding table, the LM head (held as row blocks under int4,
# ops/vocab_blocks.py).
VOCAB_MATRICES = ("embed", "lm_head")
SCALE_DTYPE = np.float16


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    bits: int           # 8 or 4
    group: int          # inputs per scale; 0: one scale per output row
    has_min: bool = False
    activations: int = 0  # 0: the matmul reads activations in the compute dtype; 8: int8
    packed: bool = False  # 4 bits: two values a byte, uint8 [..., O, I / 2] (`pack`)
    # in the order ops/native's kernel reads: packed 4-bit values (`to_lanes`), or 8-bit
    # values plus 128, uint8 [..., O, I] (`to_lanes8`; groups of 32 times a power of two,
    # without minimums)
    lanes: bool = False

    def __post_init__(self):
        if (self.bits not in (4, 8) or self.group < 0 or (self.has_min and not self.group)
                or self.activations not in (0, 8)
                or (self.activations and (self.bits, self.group) != (8, 0))
                or (self.packed and (self.bits != 4 or self.group % BLOCK))
                or (self.lanes and not (self.packed or self.lanes8_fits()))):
            raise ValueError(f"unsupported quantization format {self}")

    def lanes8_fits(self) -> bool:
        """Whether this 8-bit format can be held in the kernel's order (`to_lanes8`)."""
        blocks = self.group // BLOCK
        return (self.bits == 8 and not self.has_min and not self.activations and not self.packed
                and self.group % BLOCK == 0 and blocks > 0 and not blocks & (blocks - 1))

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
        if self.packed or self.lanes:
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
    if scheme == "int4" and name in VOCAB_MATRICES:  # its frequent rows (ops/vocab_blocks.py)
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
    largest magnitude maps to -8 exactly, scale = that value / -8, q in [-8, 7]. With
    minimums: as Q4_1, min = the group's minimum, scale = its range / 15, q in [0, 15]
    (8 bits: / 127, [0, 127])."""
    w = xp.asarray(w, xp.float32)
    *lead, rows, cols = w.shape
    g = cols if fmt.group == 0 else fmt.group
    fmt.scale_columns(cols)
    blocks = w.reshape(*lead, rows, cols // g, g)
    parts = {}
    if fmt.has_min:  # as llama.cpp's Q4_1: the group's range onto [0, 15] (8 bits: 127)
        parts["min"] = blocks.min(-1).astype(SCALE_DTYPE)
        blocks = blocks - parts["min"].astype(xp.float32)[..., None]
        hi = 15 if fmt.bits == 4 else 127
        scale, lo = blocks.max(-1) / hi, 0
    elif fmt.bits == 8:
        scale, lo, hi = xp.abs(blocks).max(-1) / 127, -127, 127
    else:  # the first value of largest magnitude, as llama.cpp picks it; a one-hot select
        # rather than a gather (exact: one value summed with zeros)
        first = xp.abs(blocks).argmax(-1)[..., None] == xp.arange(g)
        scale, lo, hi = xp.where(first, blocks, 0).sum(-1) / -8, -8, 7
    scale = scale.astype(SCALE_DTYPE)  # the values are rounded against the stored scale
    with np.errstate(divide="ignore"):
        inv = xp.where(scale == 0, 0.0, 1.0 / scale.astype(xp.float32))
    q = xp.clip(xp.rint(blocks * inv[..., None]), lo, hi).astype(xp.int8)
    return {"q": q.reshape(w.shape), "scale": scale, **parts}


def pack(q, symmetric: bool, *, lanes: bool = False, xp=np):
    """4-bit values int8 [..., O, I] -> uint8 [..., O, I / 2], llama.cpp's Q4 block layout:
    in each block of 32 inputs, byte j holds input j in its low nibble and input j + 16 in
    its high one. Symmetric values ([-8, 7]) are stored plus 8, as Q4_0 stores them. With
    `lanes`, each row's whole groups of 16 blocks then reordered by `to_lanes`."""
    *lead, rows, cols = q.shape
    blocks = q.reshape(*lead, rows, cols // BLOCK, 2, BLOCK // 2).astype(xp.int32)
    if symmetric:
        blocks = blocks + 8
    packed = (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).astype(xp.uint8).reshape(
        *lead, rows, cols // 2)
    return to_lanes(packed, xp=xp) if lanes else packed


def unpack(q, symmetric: bool, *, lanes: bool = False, xp=jnp):
    """`pack`'s inverse: uint8 [..., O, I / 2] -> int8 values [..., O, I]."""
    if lanes:
        q = from_lanes(q, xp=xp)
    *lead, rows, half = q.shape
    blocks = q.reshape(*lead, rows, half // (BLOCK // 2), BLOCK // 2)
    values = xp.concatenate([blocks & 15, blocks >> 4], axis=-1).astype(xp.int8)
    return (values - 8 if symmetric else values).reshape(*lead, rows, 2 * half)


def _swap(packed, shape: tuple, xp):
    """Each row's whole groups of LANE_BLOCKS blocks (256 bytes) seen as `shape` with its
    first two axes swapped; the bytes after them kept."""
    *lead, rows, half = packed.shape
    whole = half // (LANE_BLOCKS * BLOCK // 2) * (LANE_BLOCKS * BLOCK // 2)
    if not whole:
        return packed
    groups = packed[..., :whole].reshape(*lead, rows, -1, *shape)
    groups = xp.swapaxes(groups, -3, -2).reshape(*lead, rows, whole)
    return groups if whole == half else xp.concatenate([groups, packed[..., whole:]], axis=-1)


def to_lanes(packed, *, xp=np):
    """Packed 4-bit values in `pack`'s order -> the order ops/native's kernel reads: in each
    row's whole groups of 16 blocks (256 bytes), byte 64k + 4b + j holds block b's byte
    4k + j (block b's 16 bytes as 4 parts of 4, part k of the 16 blocks one after another:
    a part of every block a 64-byte register, a block a 32-bit lane of it, as the kernel
    sums them). The blocks after the last whole group keep `pack`'s order."""
    return _swap(packed, (LANE_BLOCKS, 4, 4), xp)  # [blocks, parts, 4] -> [parts, blocks, 4]


def from_lanes(packed, *, xp=jnp):
    """`to_lanes`' inverse."""
    return _swap(packed, (4, LANE_BLOCKS, 4), xp)


def to_lanes8(q, *, xp=np):
    """8-bit values int8 [..., O, I] -> uint8, each plus 128, in the order ops/native's kernel
    reads them (qmatmul.cc's `Lanes8Tile`): in each row's whole groups of 16 blocks (512
    values), byte 128k + 64h + 4b + j holds block b's input 16h + 4k + j (part k of every
    block at the places of a packed block's low nibbles, h = 0, then of its high ones, h = 1:
    `to_lanes`' order); the blocks after them by quads of 4 (the last may hold fewer, n),
    byte 16nh + 16b + j of a quad holding its block b's input 16h + j."""
    u = (q.astype(xp.int16) + 128).astype(xp.uint8)
    return _regroup(u, (LANE_BLOCKS, 2, 4, 4), lambda n: (n, 2, 16), xp)


def from_lanes8(u, *, xp=jnp):
    """`to_lanes8`'s inverse: int8 [..., O, I]."""
    q = _regroup(u, (4, 2, LANE_BLOCKS, 4), lambda n: (2, n, 16), xp)
    return (q.astype(xp.int16) - 128).astype(xp.int8)


def _regroup(values, shape: tuple, quad, xp):
    """Each row's whole groups of LANE_BLOCKS blocks (512 values) seen as `shape`, and then
    its quads of blocks (the last of n < 4 blocks, if any) as `quad(n)`, each with its first
    and third (a quad's: second) axes swapped."""
    *lead, rows, cols = values.shape
    width = LANE_BLOCKS * BLOCK
    whole = cols // width * width
    quads = (cols - whole) // (4 * BLOCK) * (4 * BLOCK)
    parts = []
    if whole:
        groups = values[..., :whole].reshape(*lead, rows, -1, *shape)
        parts.append(xp.swapaxes(groups, -4, -2).reshape(*lead, rows, whole))
    rest = (cols - whole - quads) // BLOCK  # blocks of the last quad, if it is not whole
    for start, stop, n in ((whole, whole + quads, 4), (whole + quads, cols, rest)):
        if stop > start:
            blocks = values[..., start:stop].reshape(*lead, rows, -1, *quad(n))
            parts.append(xp.swapaxes(blocks, -3, -2).reshape(*lead, rows, stop - start))
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=-1)


def dequantize(q, scale, minimum=None, *, lanes: bool = False, cols: int | None = None,
               xp=jnp, dtype=jnp.float32):
    """[..., O, I] values (or packed, uint8 [..., O, I / 2], in `to_lanes`' order with
    `lanes`; or, where `cols` says a row holds I = cols of them, uint8 in `to_lanes8`'s) and
    [..., O, G] scales (and minimums) -> the float weight."""
    if q.dtype == xp.uint8 and q.shape[-1] == cols:
        q = from_lanes8(q, xp=xp)
    elif q.dtype == xp.uint8:
        q = unpack(q, minimum is None, lanes=lanes, xp=xp)
    *lead, rows, cols = q.shape
    groups = scale.shape[-1]
    w = q.reshape(*lead, rows, groups, cols // groups).astype(dtype)
    w = w * scale.astype(dtype)[..., None]
    if minimum is not None:
        w = w + minimum.astype(dtype)[..., None]
    return w.reshape(q.shape)


def held_bytes(a) -> int:
    """Bytes the device holds for array `a`: 4-bit dtypes are packed two a byte there, though
    jax's `nbytes` counts one each."""
    return a.size // 2 if a.dtype in (jnp.int4, jnp.uint4) else a.nbytes

