"""Quantized matmuls of a few rows on CPU through xlaserve's own kernel (ops/native/qmatmul.cc,
an XLA FFI custom call built on first use): `linear` (ops/quantized_linear.py) hands a
product here where `native_fits` says the kernel takes it.

Up to NATIVE_MAX_ROWS rows of float32 on one CPU device (any number under --batch-invariant,
`any_rows`, and for packed 4-bit values with x in 8 bits where VNNI multiplies them,
`many_rows_pay`). The kernel converts 8-bit values to float in registers and multiplies in
float32; 4-bit values run as exact integer dot products with each block of 32 inputs of a
row held as 24-bit integers, float32's precision at the block's largest value (`x_bits` 24),
or as 8-bit ones (`x_bits` 8, --cpu-activation-dtype int8: a third of the dot products,
llama.cpp's Q8 activations' precision); the output rows are split over XLA's intra-op
threads. Each row's result is the same sequence of operations whatever the other rows are,
so a row's numbers do not depend on its batch (XLA's dot gives no such promise; at many rows
it is faster). XLA's own one-row product runs on one thread, and at a few rows XLA
materializes the dequantized matrix before its dot. A model whose matmuls run here
(`runs_native`) holds its 4-bit matrices packed two values a byte (ops/quantization.pack), in
the order the kernel reads them (ops/quantized_linear.held_formats): half the memory, and half
the bytes a lone decode reads. A layer of a stacked matrix reaches the kernel as the whole
stack and an index (ops/quantized_linear.stacked): XLA copies a slice before a custom call
reads it (docs/performance-log.md, "A CPU kernel for quantized matmuls, and 4-bit weights two
a byte").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ops import native
from ops.quantization import BLOCK

NATIVE_MAX_ROWS = 8  # the most rows the kernel takes, unless `any_rows` (native_fits)
NATIVE_MAX_MATRICES = 4  # the most matrices one call of it multiplies the same rows by
# --cpu-activation-dtype: the bits each input of x keeps in the kernel's products with packed
# 4-bit weights (per block of 32, scaled to the block's largest |x|)
X_BITS = {"float32": 24, "int8": 8}
FULL_X_BITS = X_BITS["float32"]  # the default: float32's precision at each block's largest |x|


def runs_native(dtype, quant: dict, *, sharded: bool) -> bool:
    """Whether a model's quantized matmuls of a few rows run in ops/native's kernel: float32
    activations, weight-only formats, one CPU device (XLA splits the matmuls under a
    mesh), and a kernel that could be built here. Such a model also holds its 4-bit
    matrices packed (ops/quantized_linear.held_formats)."""
    return bool(quant and not sharded and jnp.dtype(dtype) == jnp.float32
                and not any(fmt.activations for fmt in quant.values())
                and jax.default_backend() == "cpu" and native.available("qmatmul"))


def native_fits(x: jax.Array, w, any_rows: bool = False, lanes: bool = False,
                x_bits: int = FULL_X_BITS, wide_dtype=None) -> bool:
    """Whether ops/native's kernel takes this product: float32 rows (up to NATIVE_MAX_ROWS
    of them, or any number with `any_rows` or where `many_rows_pay`), and a matrix of
    one-per-int8 values with float16 scales per group of a multiple of 16 inputs (every
    format of SCHEMES but w8a8's, and GGUF's), or of values in its order (`lanes`: packed
    4-bit ones, or 8-bit ones plus 128 without minimums, uint8 rows as long as x's) with
    groups of 32 times a power of two."""
    if not isinstance(w, dict) or x.dtype != jnp.float32 or x.ndim != 2 or x.shape[0] < 1:
        return False
    q, scale = w["q"], w["scale"]
    ordered = q.dtype == jnp.uint8  # packed 4-bit, or 8-bit in the kernel's order (lanes8)
    lanes8 = ordered and q.shape[-1] == x.shape[1]
    if x.shape[0] > NATIVE_MAX_ROWS and not (
            any_rows or (ordered and not lanes8 and many_rows_pay(x_bits, wide_dtype))):
        return False
    groups, cols = scale.shape[-1], q.shape[-1] * (2 if ordered and not lanes8 else 1)
    return (((ordered and lanes) or q.dtype == jnp.int8) and scale.dtype == jnp.float16
            and cols == x.shape[1] and cols % groups == 0
            and (cols // groups) % (BLOCK if ordered else 16) == 0 and groups <= 1024
            and not (ordered and (cols // groups // BLOCK) & (cols // groups // BLOCK - 1))
            and not (lanes8 and "min" in w)
            and q.ndim == (3 if "layer" in w else 2) and native.available("qmatmul"))


def many_rows_pay(x_bits: int, wide_dtype=None) -> bool:
    """Whether the kernel's products with packed 4-bit values beat XLA's at every row count (a
    prompt's chunk, a batch of decodes), not only up to NATIVE_MAX_ROWS: with x in 8 bits on
    a CPU with VNNI's 8-bit dot products (`native.multiplies_bytes`), where XLA dequantizes
    the matrix every step and multiplies in float32. A prompt's 512-token chunk of
    Qwen2.5-Coder-1.5B (--quantization int4) took 4.4 s against XLA's 7.4, 64 tokens 0.58 s
    against 1.26, on a 2-vCPU Zen 4 EPYC (docs/performance-log.md, "Prompts through the 4-bit
    kernel with 8-bit x"). With x in 24 bits (the default: three times the dot products)
    XLA's product stays: the default model's 512 tokens took 0.89-0.97 s there against 0.69-0.76.
    So does an XLA product asked to multiply in another dtype (`wide_dtype`, --cpu-matmul-dtype
    bfloat16: on AMX 5-7x float32's; not measured against the kernel). The rows then take x in
    8 bits as a decode's do, so a token's numbers no longer depend on whether it was a
    prompt's or a decode's."""
    return x_bits == 8 and wide_dtype is None and native.multiplies_bytes()


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
