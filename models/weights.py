"""From checkpoint tensors to our parameters: the HF name map, shape checks, and assembly.

Every source (HF safetensors, GGUF) is first expressed in HF names and HF layout, which is
ours too ([out, in] matrices); `hf_tensor_rules` says, for each HF tensor, where it goes in
`param_specs` and what shape it must have. Assembly fills one host buffer per parameter
(already in the target dtype, or quantized: ops/quantization.py) and reports any missing or
mis-shaped tensor by name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from models.config import ModelConfig
from models.gguf_blocks import common_format
from models.parameters import QUANTIZABLE
from models.progress import progress_bar
from models.registry import model_class, param_specs
from ops.quantization import (
    VOCAB_MATRICES,
    QuantFormat,
    dequantize,
    pack,
    quantize,
    scheme_format,
    to_lanes8,
)
from ops.quantized_linear import held_formats
from ops.vocab_blocks import RARE, frequent_rows, rows_of, split_rows


class WeightError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class TensorRule:
    target: str                 # our parameter name (see param_specs)
    layer: int | None           # slice of the stacked parameter, or None
    shape: tuple[int, ...]      # expected shape, HF's and ours


def hf_tensor_rules(cfg: ModelConfig) -> dict[str, TensorRule]:
    E, V = cfg.hidden_size, cfg.vocab_size
    rules = {
        "model.embed_tokens.weight": TensorRule("embed", None, (V, E)),
        "model.norm.weight": TensorRule("final_norm", None, (E,)),
    }
    if not cfg.tie_word_embeddings:
        rules["lm_head.weight"] = TensorRule("lm_head", None, (V, E))
    layer = model_class(cfg.architecture).layer_tensors(cfg)
    for i in range(cfg.num_layers):
        for name, (target, shape) in layer.items():
            rules[f"model.layers.{i}.{name}"] = TensorRule(f"layers.{target}", i, shape)
    return rules


def quant_plan(cfg: ModelConfig, quantization: str | None,
               stored: dict[str, set] | None = None) -> dict[str, QuantFormat]:
    """Which matrices are quantized, and how. `stored`: our parameter name -> the formats its
    source tensors already have (a QuantFormat, or None for float). A parameter whose
    tensors are all stored in formats we take over (models/gguf_blocks.py KEPT) keeps the
    narrowest one that holds them all (their `common_format`), under "auto" and under a
    weight-only scheme of at least its bits (requantizing would only lose); w8a8's matmuls
    need their own format, so it requantizes. Under a scheme the others get its format,
    under "auto" they stay float. None or "none": every weight in float. Under int4 an
    8-bit vocabulary matrix `name` holds its frequent rows only, the rest are `name + RARE`
    in int4 (ops/vocab_blocks.py FREQUENT_ROWS)."""
    if quantization in (None, "none"):
        return {}
    plan = {}
    scheme = None if quantization == "auto" else scheme_format(quantization)
    for name in QUANTIZABLE:
        if name == "lm_head" and cfg.tie_word_embeddings:
            continue
        kept = common_format((stored or {}).get(name, {None}))
        wanted = None if scheme is None else scheme_format(quantization, name)
        if kept is not None and (scheme is None or kept == wanted or (
                not scheme.activations and kept.bits <= scheme.bits)):
            plan[name] = kept
        elif wanted is not None:
            plan[name] = wanted
    if quantization == "int4" and frequent_rows(cfg.vocab_size) is not None:
        for name in VOCAB_MATRICES:  # 8 bits for the frequent rows only (ops/vocab_blocks.py)
            if name in plan and plan[name].bits == 8:
                plan[name + RARE] = scheme_format("int4")
    return plan


def split_vocab(name: str, w, quant: dict[str, QuantFormat]) -> list[tuple[str, object]]:
    """[(parameter, value)] for float or quantized matrix `name`: itself, or an int4
    vocabulary matrix's frequent rows and the rest (`quant_plan`), the rest made float (a
    kept GGUF Q8_0 table's values, exact) to be quantized to int4."""
    if name + RARE not in quant:
        return [(name, w)]
    frequent, rare = split_rows(w, frequent_rows(rows_of(w)))
    if isinstance(rare, dict):
        rare = dequantize(rare["q"], rare["scale"], rare.get("min"), xp=np)
    return [(name, frequent), (name + RARE, rare)]


# HF tensors that carry no parameter of ours and may be skipped.
def _ignorable(name: str, cfg: ModelConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (
        cfg.tie_word_embeddings and name == "lm_head.weight")


def assemble_params(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, str, Callable[[], np.ndarray | dict]]],
    *,
    source: str,
    dtype,
    quant: dict[str, QuantFormat] | None = None,
    total: int | None = None,
) -> dict:
    """Build the pure parameter dict (nested like the model's state) on the host.

    `tensors` yields (hf_name, display_name, load) where `load()` returns the tensor in HF
    layout: a float array, or already quantized parts {"q", "scale"[, "min"]} in a format
    of `quant`; `display_name` is the name as the source file spells it (for errors).
    Matrices named in `quant` are quantized here when they arrive in float."""
    quant = quant or {}
    rules = hf_tensor_rules(cfg)
    specs = param_specs(cfg, quant)
    np_dtype = jnp.dtype(dtype)
    buffers = {name: np.empty(spec.shape, spec.dtype or np_dtype) for name, spec in specs.items()}
    filled: set[str] = set()
    bar = progress_bar(tensors, total=total, desc=f"Loading {os.path.basename(source)}",
                       unit="tensor")
    for hf_name, shown, load in bar:
        rule = rules.get(hf_name)
        if rule is None:
            if _ignorable(hf_name, cfg):
                continue
            raise WeightError(f"{source}: unexpected tensor {shown!r} for a "
                              f"{cfg.architecture} with {cfg.num_layers} layers")
        try:
            w = load()
        except WeightError:
            raise
        except Exception as e:
            raise WeightError(f"{source}: cannot read tensor {shown!r}: {e}") from e
        shape = tuple((w["q"] if isinstance(w, dict) else w).shape)
        if shape != rule.shape:
            raise WeightError(f"{source}: tensor {shown!r} has shape {shape}, "
                              f"expected {rule.shape}")
        for target, value in split_vocab(rule.target, w, quant):
            fmt = quant.get(target)
            if fmt is None:
                if isinstance(value, dict):
                    value = dequantize(value["q"], value["scale"], value.get("min"), xp=np)
                parts = {"": value if value.dtype == np_dtype
                         else np.asarray(value, np.float32)}
            else:
                if not isinstance(value, dict):
                    value = quantize(value, fmt)
                parts = {"": value["q"], "_scale": value["scale"]}
                if "min" in value:
                    parts["_min"] = value["min"]
            for suffix, part in parts.items():
                buffer = buffers[target + suffix]
                if rule.layer is None:
                    buffer[...] = part
                else:
                    buffer[rule.layer] = part
        filled.add(hf_name)
    missing = [name for name in rules if name not in filled]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightError(f"{source}: missing tensor(s) {', '.join(missing[:5])}{more}")
    return nest(buffers)


def quantize_params(params: dict, quant: dict[str, QuantFormat], *, xp=np) -> dict:
    """Nested float parameters -> the matrices in `quant` quantized (`name` and
    `name_scale`[, `name_min`]), the rest as they are; on the host, or (xp=jnp, under jit)
    on the device."""
    flat = traverse_util.flatten_dict(params, sep=".")
    for name in VOCAB_MATRICES:
        if name in flat:
            flat.update(split_vocab(name, flat[name], quant))
    for name, fmt in quant.items():
        parts = quantize(flat[name], fmt, xp=xp)
        flat[name] = parts.pop("q").astype(fmt.storage_dtype())
        flat.update({f"{name}_{part}": value for part, value in parts.items()})
    return nest(flat)


def pack_params(params: dict, quant: dict[str, QuantFormat], held: dict[str, QuantFormat],
                *, xp=np) -> dict:
    """Nested parameters with one value per int8 in `quant`'s formats -> those `held` packs
    two a byte (ops/quantization.pack, in the CPU kernel's order where `held` says `lanes`),
    or holds as 8-bit values in that order (ops/quantization.to_lanes8)."""
    flat = traverse_util.flatten_dict(params, sep=".")
    for name, fmt in held.items():
        if fmt.packed and not quant[name].packed:
            flat[name] = pack(flat[name], not fmt.has_min, lanes=fmt.lanes, xp=xp)
        elif fmt.lanes and not fmt.packed and not quant[name].lanes:
            flat[name] = to_lanes8(flat[name], xp=xp)
    return nest(flat)


def nest(flat: dict[str, np.ndarray]) -> dict:
    """{'layers.wq': x, 'embed': y} -> {'layers': {'wq': x}, 'embed': y}."""
    out: dict = {}
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def abstract_model(cfg: ModelConfig, dtype, attention_backend: str = "reference", mesh=None,
                   quant: dict[str, QuantFormat] | None = None):
    """The model with ShapeDtypeStruct leaves: no memory, no random init."""
    cls = model_class(cfg.architecture)
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0),
                                      attention_backend=attention_backend, mesh=mesh,
                                      quant=quant))


def place(params: dict, shardings: dict | None) -> dict:
    """Host arrays onto devices: whole onto the default device, or each device receiving
    only its own shard (also across processes: every process fills its own devices)."""
    if shardings is None:
        return jax.tree.map(jax.device_put, params)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
        params, shardings)


def build_model(cfg: ModelConfig, params: dict, dtype,
                attention_backend: str = "reference", mesh=None,
                quant: dict[str, QuantFormat] | None = None) -> nnx.Module:
    """Put host parameters on the device(s) and bind them to a model; with a tensor-parallel
    `mesh`, `cfg` and `params` are the sharded ones (see models/sharding.py)."""
    from models.sharding import param_shardings

    graphdef, state = nnx.split(abstract_model(cfg, dtype, attention_backend, mesh, quant))
    shardings = None if mesh is None else param_shardings(cfg, mesh, quant)
    nnx.replace_by_pure_dict(state, place(params, shardings))
    return nnx.merge(graphdef, state)


def random_model(cfg: ModelConfig, dtype, *, seed: int = 0, attention_backend: str = "reference",
                 mesh=None, quantization: str | None = None) -> nnx.Module:
    """Random weights of real shapes (benchmarks without the weights), made on the devices,
    directly in their shardings under a tensor-parallel `mesh`, and quantized there."""
    from models.sharding import param_shardings, sharded_config
    from ops.shard import TENSOR_AXIS

    run_cfg = cfg if mesh is None else sharded_config(cfg, mesh.shape[TENSOR_AXIS])
    plan = quant_plan(run_cfg, quantization)
    quant = held_formats(dtype, plan, sharded=mesh is not None)

    def init():
        model = model_class(run_cfg.architecture)(run_cfg, dtype=dtype, rngs=nnx.Rngs(seed))
        params = quantize_params(nnx.to_pure_dict(nnx.state(model)), plan, xp=jnp)
        return pack_params(params, plan, quant, xp=jnp)

    shardings = None if mesh is None else param_shardings(run_cfg, mesh, quant)
    graphdef, state = nnx.split(abstract_model(run_cfg, dtype, attention_backend, mesh, quant))
    nnx.replace_by_pure_dict(state, jax.jit(init, out_shardings=shardings)())
    return nnx.merge(graphdef, state)
