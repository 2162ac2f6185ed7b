"""A GGUF file's quantized blocks as our formats (ops/quantization.py): values one per int8
(or, for 4 bits, later packed two a byte) with float16 scales (and minimums) per group.

llama.cpp's block types hold integer values with a scale (and a minimum) per block of 32,
or per sub-block of a 256-value super-block whose sub-block scales are small integers times
the super-block's float16 `d` (and `dmin`):

| type | values | per group | our format |
|---|---|---|---|
| Q8_0 | int8 | 32: d | int8, groups of 32 |
| Q4_0 | 4 bits, minus 8 | 32: d | int4, groups of 32 |
| Q4_1 | 4 bits | 32: d, m | int4 with minimums, groups of 32 |
| Q5_0 | 5 bits, minus 16 | 32: d | one a byte, groups of 32 |
| Q5_1 | 5 bits | 32: d, m | one a byte with minimums, groups of 32 |
| Q4_K | 4 bits | 32: d * sc, -dmin * m (sc, m: 6 bits) | int4 with minimums, groups of 32 |
| Q5_K | 5 bits | 32: as Q4_K | one a byte with minimums, groups of 32 |
| Q6_K | 6 bits, minus 32 | 16: d * sc (sc: int8) | one a byte, groups of 16 |

The first five are taken over bit for bit (`EXACT`): our `q * scale (+ min)` equals the
`gguf` package's dequantization. A K-type's scale and minimum are products computed in
float32 and rounded to float16 (a relative error of at most 2^-12 each; the values are
exact). A matrix stacked over layers holds one format, so a stack whose layers a file
stores in different types (Q4_K_M files mix Q4_K and Q6_K) takes the narrowest format that
holds each of them (`common_format`) and each layer's blocks are widened to it (`widen`).
Other types (Q2_K, Q3_K, the IQ types, floats) have no format here.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from ops.quantization import QuantFormat

T = gguf.GGMLQuantizationType

KEPT = {
    T.Q8_0: QuantFormat(8, 32),
    T.Q4_0: QuantFormat(4, 32),
    T.Q4_1: QuantFormat(4, 32, has_min=True),
    T.Q5_0: QuantFormat(8, 32),
    T.Q5_1: QuantFormat(8, 32, has_min=True),
    T.Q4_K: QuantFormat(4, 32, has_min=True),
    T.Q5_K: QuantFormat(8, 32, has_min=True),
    T.Q6_K: QuantFormat(8, 16),
}
EXACT = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1})


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., 16k] -> [..., 32k]: each run of bytes' low nibbles, then its high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _fifth_bits(bits: np.ndarray, count: int) -> np.ndarray:
    """A little-endian bit field [n, count / 8] -> its bits as uint8 [n, count]."""
    return np.unpackbits(bits, axis=-1, bitorder="little")[:, :count]


def _decode(blocks: np.ndarray, tensor_type) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks uint8 [n, bytes] -> (values int8 [n, V], scales float32 [n, V / group],
    minimums float32 or None)."""
    n = blocks.shape[0]
    if tensor_type == T.Q8_0:
        return np.ascontiguousarray(blocks[:, 2:]).view(np.int8), _f16(blocks, 0), None
    if tensor_type in (T.Q4_0, T.Q4_1):
        q = _nibbles(blocks[:, -16:]).astype(np.int8)
        if tensor_type == T.Q4_0:
            return q - 8, _f16(blocks, 0), None
        return q, _f16(blocks, 0), _f16(blocks, 2)
    if tensor_type in (T.Q5_0, T.Q5_1):
        high = _fifth_bits(blocks[:, -20:-16], 32)
        q = (_nibbles(blocks[:, -16:]) | (high << 4)).astype(np.int8)
        if tensor_type == T.Q5_0:
            return q - 16, _f16(blocks, 0), None
        return q, _f16(blocks, 0), _f16(blocks, 2)
    if tensor_type in (T.Q4_K, T.Q5_K):
        # d, dmin, 12 bytes of 6-bit sub-block scales and minimums, [Q5_K: 32 bytes of fifth
        # bits,] 128 bytes: four runs of 32 bytes, each two sub-blocks of 32 (low, high nibbles)
        sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        q = _nibbles(blocks[:, -128:].reshape(n, 4, 32)).reshape(n, 256)
        if tensor_type == T.Q5_K:  # sub-block j's fifth bits: bit j of each of 32 bytes
            high = _fifth_bits(blocks[:, 16:48].reshape(n * 32, 1), 8).reshape(n, 32, 8)
            q = q | (high.transpose(0, 2, 1).reshape(n, 256) << 4)
        scale = _f16(blocks, 0) * sc.astype(np.float32)
        return q.astype(np.int8), scale, -(_f16(blocks, 2) * m.astype(np.float32))
    if tensor_type == T.Q6_K:
        # 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, d: two halves of
        # 128 values; in a half, values 32j .. 32j + 31 take nibble run j % 2's low (j < 2)
        # or high nibbles and bits 2j, 2j + 1 of the half's 32 high-part bytes
        low = blocks[:, :128].reshape(n, 2, 2, 32)
        low = np.concatenate([low & 0x0F, low >> 4], axis=2)  # [n, 2, 4, 32]
        high = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        q = ((low | ((high & 3) << 4)).astype(np.int8) - 32).reshape(n, 256)
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        return q, _f16(blocks, 208) * sc, None
    raise ValueError(f"no format of ours holds GGUF {tensor_type.name} blocks")


def repack(raw: np.ndarray, tensor_type, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """A tensor of a KEPT type, its bytes -> {"q": int8 [..., O, I], "scale" (and "min"):
    float16 [..., O, I / group]} of KEPT[tensor_type], `w = q * scale (+ min)` (see the
    module docstring for how exact)."""
    fmt = KEPT[tensor_type]
    values, size = gguf.GGML_QUANT_SIZES[tensor_type]
    *lead, cols = shape
    if raw.size * values != math.prod(shape) * size:
        raise ValueError(f"{raw.size} bytes of {tensor_type.name}, expected "
                         f"{math.prod(shape) // values * size} (truncated file?)")
    q, scale, minimum = _decode(raw.reshape(-1, size), tensor_type)
    groups = (*lead, cols // fmt.group)
    out = {"q": q.reshape(shape), "scale": scale.astype(np.float16).reshape(groups)}
    if minimum is not None:
        out["min"] = minimum.astype(np.float16).reshape(groups)
    return out


def holds(fmt: QuantFormat | None, stored: QuantFormat) -> bool:
    """Whether `fmt` holds the values of KEPT format `stored` exactly (`widen`)."""
    return (fmt is not None and not fmt.activations and not fmt.packed and fmt.group > 0
            and stored.bits <= fmt.bits and stored.group % fmt.group == 0
            and (fmt.has_min or not stored.has_min))


def common_format(formats: set) -> QuantFormat | None:
    """The narrowest format that holds every one of `formats` (KEPT's): the most bits, the
    smallest group, minimums if any has them; None if one is None (a float tensor) or the
    groups do not divide each other."""
    if not formats or None in formats:
        return None
    fmt = QuantFormat(max(f.bits for f in formats), min(f.group for f in formats),
                      has_min=any(f.has_min for f in formats))
    return fmt if all(holds(fmt, f) for f in formats) else None


def widen(parts: dict[str, np.ndarray], fmt: QuantFormat) -> dict[str, np.ndarray]:
    """Parts of a KEPT format -> the same weight in `fmt` (`common_format` of it and
    others): scales repeated over smaller groups, a zero minimum where `fmt` has minimums,
    and symmetric 4-bit values moved onto [0, 15] (min = -8 * scale, exact) where `fmt` holds
    4 bits with minimums (packed as Q4_1's)."""
    q, scale, minimum = parts["q"], parts["scale"], parts.get("min")
    repeat = q.shape[-1] // scale.shape[-1] // fmt.group
    if repeat > 1:
        scale = np.repeat(scale, repeat, axis=-1)
        minimum = None if minimum is None else np.repeat(minimum, repeat, axis=-1)
    if fmt.has_min and minimum is None:
        if fmt.bits == 4:
            q, minimum = q + np.int8(8), (scale.astype(np.float32) * -8).astype(np.float16)
        else:
            minimum = np.zeros_like(scale)
    out = {"q": q, "scale": scale}
    if minimum is not None:
        out["min"] = minimum
    return out
