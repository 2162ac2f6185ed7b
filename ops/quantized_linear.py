"""The quantized matmul, `linear`: x times a float or quantized [out, in] weight (the formats
of ops/quantization.py), the one matmul every weight of a model goes through, in a form
chosen per static shape from measurements (docs/performance.md):

- up to NATIVE_MAX_ROWS rows of float32 on one CPU device (any number under
  --batch-invariant): xlaserve's own kernel (ops/cpu_linear.py, ops/native/qmatmul.cc),
  whose rows' results do not depend on their batch;
- on a GPU, a layer of a stack handed whole (`stacked`: float and per-channel int8 from 2
  rows, group formats and packed 4-bit values at any row count up to
  ops/pallas_gpu_matmul.MAX_ROWS) and the int4 head's row blocks: ops/pallas_gpu_matmul,
  which reads the stack in place and dequantizes in registers;
- everything else in XLA's own forms (ops/xla_linear.py): on a GPU one row of float and
  per-channel int8 weights as a multiply and a sum, fused with the layer's slice; elsewhere
  the dequantization fused into the matrix-vector product at one row, dequantized in
  cache-sized blocks above; w8a8's int8 x int8 product.

Where a model's matmuls run decides how it holds its 4-bit matrices (`held_formats`): packed
two values a byte under the CPU kernel (in its order) and on one GPU.
"""

from __future__ import annotations

import dataclasses

import jax

from ops import cpu_linear, native, pallas_gpu_matmul, xla_linear
from ops.cpu_linear import FULL_X_BITS, NATIVE_MAX_MATRICES, NATIVE_MAX_ROWS, runs_native
from ops.quantization import BLOCK


def linear(x: jax.Array, w, out_dtype=None, *, chunked: bool = True,
           int8_activations: bool = False, native: bool = False,
           any_rows: bool = False, wide_dtype=None, x_bits: int = FULL_X_BITS,
           lanes: bool = False) -> jax.Array:
    """x [T, I] @ w [O, I]^T -> [T, O]. `w` is a float array or a dict {"q", "scale"[, "min"]}:
    one layer's slice of a quantized parameter, or the whole stack [L, O, I] with its
    "layer" index (`stacked`). `out_dtype`: accumulate and return in it (float32 logits
    from bfloat16 activations). `chunked`: dequantize group formats in blocks of at most
    xla_linear.CHUNK_BYTES at more than one row (off where a mesh splits the rows).
    `int8_activations`: `w` is per-channel int8 and `x` is quantized to int8 per row (w8a8).
    `native`: run xlaserve's CPU kernel where it serves (cpu_linear.native_fits);
    `any_rows`: at any number of rows (--batch-invariant), not only up to NATIVE_MAX_ROWS
    (packed 4-bit values with `x_bits` 8 and no `wide_dtype` go there at any number where
    cpu_linear.many_rows_pay).
    `wide_dtype`: the dtype XLA's products of more than NATIVE_MAX_ROWS rows multiply in
    (xla_linear.wide_dtype), summed in `out_dtype` or x's. `x_bits`: the bits x keeps per
    block of 32 in the CPU kernel's products with packed 4-bit values (cpu_linear.X_BITS).
    `lanes`: packed 4-bit values are in the order that kernel reads
    (ops/quantization.to_lanes), the only order it takes them in (`held_formats`)."""
    if isinstance(w, dict) and not native and not int8_activations and not lanes:
        y = _stacked_kernel(x, w, out_dtype)  # (it reads packed values in `pack`'s order)
        if y is not None:
            return y
    if native and cpu_linear.native_fits(x, w, any_rows, lanes, x_bits, wide_dtype):
        y = cpu_linear.native_linear(x, w, x_bits)
        return y if out_dtype is None else y.astype(out_dtype)
    if isinstance(w, dict) and "layer" in w:
        w = {k: jax.lax.dynamic_index_in_dim(a, w["layer"], 0, False)
             for k, a in w.items() if k != "layer"}
        w = w.get("stack", w)  # a float matrix's slice
    if int8_activations:
        return xla_linear.linear_w8a8(x, w, out_dtype or x.dtype)
    if x.shape[0] == 1 and xla_linear.reduces_one_row():
        return xla_linear.row_sums(x, w, out_dtype)
    wide = wide_dtype if wide_dtype is not None and x.shape[0] > NATIVE_MAX_ROWS else None
    return xla_linear.product(x, w, out_dtype or x.dtype, chunked=chunked, wide=wide,
                              lanes=lanes)


def linears(x: jax.Array, ws: list, *, native: bool = False, **kwargs) -> list[jax.Array]:
    """`linear(x, w, ...)` for each of `ws` (same rows x): one native call for all where the
    CPU kernel takes every one of them (q, k and v; gate and up), one call of
    ops/pallas_gpu_matmul where it takes each and they are alike, else one product each."""
    any_rows, x_bits = kwargs.get("any_rows", False), kwargs.get("x_bits", FULL_X_BITS)
    if (native and 1 < len(ws) <= NATIVE_MAX_MATRICES
            and all(cpu_linear.native_fits(x, w, any_rows, kwargs.get("lanes", False), x_bits,
                                           kwargs.get("wide_dtype")) for w in ws)):
        return cpu_linear.native_linears(x, ws, x_bits)
    if (not native and not kwargs.get("int8_activations") and not kwargs.get("lanes")
            and len(ws) > 1):
        # one ops/pallas_gpu_matmul kernel for all where it takes each, alike, of one layer
        found = [_kernel_operands(x, w) if isinstance(w, dict) else None for w in ws]
        if (all(f is not None and f[1] is found[0][1] for f in found)
                and pallas_gpu_matmul.alike(x, [f[0] for f in found])):
            return pallas_gpu_matmul.stacked_matmuls(x, [f[0] for f in found], found[0][1],
                                                     kwargs.get("out_dtype"))
    return [linear(x, w, native=native, **kwargs) for w in ws]


def _kernel_operands(x: jax.Array, w: dict) -> tuple[dict, object] | None:
    """`w` as ops/pallas_gpu_matmul takes it ({"stack", "scale", "min"} and the layer index)
    where `linear` hands it there, else None: a layer handed whole with its index
    (`stacked`), float or per-channel int8 from 2 rows (one row: xla_linear.row_sums reads
    those in place) and group formats at any row count; and on a GPU a group-format matrix outside
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


def stacked(w, layer) -> dict:
    """Layer `layer` of a stacked matrix as `linear` takes it, unsliced: a quantized one for
    the CPU kernel (a slice handed to a custom call would be copied first, a cost measured
    in docs/performance-log.md, "A CPU kernel for quantized matmuls, and 4-bit weights two a
    byte"), a float one ({"stack", "layer"}) or a per-channel int8 one for
    ops/pallas_gpu_matmul from 2 rows up. `linear` slices it where XLA runs."""
    if isinstance(w, dict):
        return {**w, "layer": layer}
    return {"stack": w, "layer": layer}


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
    kernel's order"); and where that kernel multiplies bytes (native.multiplies_bytes), its
    8-bit formats in groups of 32 times a power of two in its order too (`to_lanes8`)."""
    if not holds_packed(dtype, quant, sharded=sharded):
        return dict(quant)
    lanes = runs_native(dtype, quant, sharded=sharded)
    lanes8 = lanes and native.multiplies_bytes()
    return {name: dataclasses.replace(fmt, packed=True, lanes=lanes)
            if fmt.bits == 4 and fmt.group and fmt.group % BLOCK == 0
            else dataclasses.replace(fmt, lanes=True) if lanes8 and fmt.lanes8_fits() else fmt
            for name, fmt in quant.items()}
