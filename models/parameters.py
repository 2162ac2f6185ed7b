"""Parameters described once, and read back as the matmuls take them.

A family's `float_specs` (models/llama.py) lists its parameters as `ParamSpec`s (shape, logical
axes, init, dtype); `quantized_specs` turns that table into the stored one for a quantization
plan, and the module, the loaders' abstract shapes and the shardings all derive from the
result. `weight` and `vocab_matrix` gather a matrix's stored parts for ops/quantized_linear.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ops.quantization import SCALE_DTYPE, VOCAB_MATRICES, QuantFormat
from ops.vocab_blocks import RARE, frequent_rows


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per dim
    init: str = "normal"   # "normal" | "ones" | "zeros"
    dtype: object = None   # None: the model's dtype


# Matrices that may be quantized (ops/quantization.py). Every matrix is stored [..., out, in],
# the layout of HF's Linear and of GGUF: XLA:CPU's one-row matrix-vector product is 2.5x
# faster on it than on [in, out] and no slower at more rows (docs/performance.md).
QUANTIZABLE = ("embed", "lm_head", "layers.wq", "layers.wk", "layers.wv", "layers.wo",
               "layers.w_gate", "layers.w_up", "layers.w_down")


def quantized_specs(specs: dict[str, ParamSpec], quant: dict[str, QuantFormat] | None
                    ) -> dict[str, ParamSpec]:
    """`specs` (every matrix in float), where a matrix quantized as `quant[name]` becomes `name`
    (integer values), `name_scale` and maybe `name_min`."""
    for name in quant or {}:  # an int4 vocabulary matrix's rows, split (ops/vocab_blocks)
        whole = name.removesuffix(RARE)
        if name != whole and whole in specs and whole in VOCAB_MATRICES:
            spec, rows = specs[whole], frequent_rows(specs[whole].shape[0])
            if rows is None or whole not in quant:
                raise ValueError(f"{name!r}: {whole!r} does not split")
            specs[whole] = dataclasses.replace(spec, shape=(rows, *spec.shape[1:]))
            specs[name] = dataclasses.replace(
                spec, shape=(spec.shape[0] - rows, *spec.shape[1:]))
    for name, fmt in (quant or {}).items():
        if name not in specs or name.removesuffix(RARE) not in QUANTIZABLE:
            raise ValueError(f"{name!r} is not a quantizable parameter of this model")
        spec = specs[name]
        scale_shape = (*spec.shape[:-1], fmt.scale_columns(spec.shape[-1]))
        specs[name] = dataclasses.replace(spec, shape=fmt.storage_shape(spec.shape),
                                          init="zeros", dtype=fmt.storage_dtype())
        # Group scales split with their inputs; one scale per row is the same on every shard.
        axes = spec.axes if fmt.group else (*spec.axes[:-1], "row_scale")
        specs[name + "_scale"] = ParamSpec(scale_shape, axes, "ones", SCALE_DTYPE)
        if fmt.has_min:
            specs[name + "_min"] = ParamSpec(scale_shape, axes, "zeros", SCALE_DTYPE)
    return specs


def init_param(spec: ParamSpec, key, dtype):
    dtype = spec.dtype or dtype
    if spec.init == "ones":
        return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, dtype)
    return (0.02 * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)


def whole_matrices(stack: dict, *, native: bool, kernel: bool,
                   int8_activations: bool) -> set[str]:
    """The stacked matrices whose products take the whole stack and the layer index
    (ops.quantized_linear.stacked) instead of a slice: every quantized one under the CPU
    kernel (`native`); under ops/pallas_gpu_matmul (`kernel`) the float ones and the
    weight-only quantized ones (per-channel int8 and the group formats; w8a8's are sliced)."""
    quantized = {n for n in stack if n + "_scale" in stack}
    if native:
        return quantized
    if not kernel:
        return set()
    parts = {n + suffix for n in quantized for suffix in ("_scale", "_min")}
    floats = {n for n, a in stack.items() if a.ndim == 3 and n not in quantized | parts}
    if int8_activations:
        return floats
    return floats | {n for n in quantized if stack[n + "_scale"].shape[-1] > 1  # groups
                     or (n + "_min" not in stack and stack[n].dtype == jnp.int8)}


def weight(params: dict, name: str):
    """A matrix as `linear` takes it: the float array, or its quantized parts."""
    if name + "_scale" not in params:
        return params[name]
    parts = {"q": params[name], "scale": params[name + "_scale"]}
    if name + "_min" in params:
        parts["min"] = params[name + "_min"]
    return parts


def vocab_matrix(params: dict, name: str) -> tuple:
    """A vocabulary matrix as row blocks (ops/vocab_blocks.py `embedding`, `vocab_linear`):
    the whole one, or under int4 its frequent rows and the rest."""
    if name + RARE in params:
        return weight(params, name), weight(params, name + RARE)
    return (weight(params, name),)
