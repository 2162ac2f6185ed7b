"""From checkpoint tensors to our parameters: the HF name map, shape checks, and assembly.

Every source (HF safetensors, GGUF) is first expressed in HF names and HF layout;
`hf_tensor_rules` says, for each HF tensor, where it goes in `param_specs`, what
shape it must have, and how to transpose it. Assembly fills one host buffer per
parameter (already in the target dtype) and reports any missing or mis-shaped
tensor by name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.llama import Llama, param_specs
from models.progress import progress_bar


class WeightError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class TensorRule:
    target: str                 # our parameter name (see param_specs)
    layer: int | None           # slice of the stacked parameter, or None
    shape: tuple[int, ...]      # expected shape in the HF layout
    to_ours: Callable[[np.ndarray], np.ndarray]


def hf_tensor_rules(cfg: ModelConfig) -> dict[str, TensorRule]:
    E, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    same = lambda w: w
    t = lambda w: w.T
    rules = {
        "model.embed_tokens.weight": TensorRule("embed", None, (V, E), same),
        "model.norm.weight": TensorRule("final_norm", None, (E,), same),
    }
    if not cfg.tie_word_embeddings:
        rules["lm_head.weight"] = TensorRule("lm_head", None, (V, E), t)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": ("attn_norm", (E,), same),
            "self_attn.q_proj.weight": ("wq", (H * D, E), lambda w: w.T.reshape(E, H, D)),
            "self_attn.k_proj.weight": ("wk", (K * D, E), lambda w: w.T.reshape(E, K, D)),
            "self_attn.v_proj.weight": ("wv", (K * D, E), lambda w: w.T.reshape(E, K, D)),
            "self_attn.o_proj.weight": ("wo", (E, H * D), lambda w: w.T.reshape(H, D, E)),
            "post_attention_layernorm.weight": ("mlp_norm", (E,), same),
            "mlp.gate_proj.weight": ("w_gate", (F, E), t),
            "mlp.up_proj.weight": ("w_up", (F, E), t),
            "mlp.down_proj.weight": ("w_down", (E, F), t),
        }
        if cfg.attention_bias:
            layer |= {
                "self_attn.q_proj.bias": ("bq", (H * D,), lambda b: b.reshape(H, D)),
                "self_attn.k_proj.bias": ("bk", (K * D,), lambda b: b.reshape(K, D)),
                "self_attn.v_proj.bias": ("bv", (K * D,), lambda b: b.reshape(K, D)),
            }
        for name, (target, shape, fn) in layer.items():
            rules[p + name] = TensorRule(f"layers.{target}", i, shape, fn)
    return rules


# HF tensors that carry no parameter of ours and may be skipped.
def _ignorable(name: str, cfg: ModelConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (
        cfg.tie_word_embeddings and name == "lm_head.weight")


def assemble_params(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, str, Callable[[], np.ndarray]]],
    *,
    source: str,
    dtype,
    total: int | None = None,
) -> dict:
    """Build the pure parameter dict (nested like the model's state) on the host.

    `tensors` yields (hf_name, display_name, load) where `load()` returns the tensor in
    HF layout; `display_name` is the name as the source file spells it (for errors).
    """
    rules = hf_tensor_rules(cfg)
    specs = param_specs(cfg)
    np_dtype = jnp.dtype(dtype)
    buffers = {name: np.empty(spec.shape, np_dtype) for name, spec in specs.items()}
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
        if tuple(w.shape) != rule.shape:
            raise WeightError(f"{source}: tensor {shown!r} has shape {tuple(w.shape)}, "
                              f"expected {rule.shape}")
        w = rule.to_ours(np.asarray(w, np.float32) if w.dtype != np_dtype else w)
        if rule.layer is None:
            buffers[rule.target][...] = w
        else:
            buffers[rule.target][rule.layer] = w
        filled.add(hf_name)
    missing = [name for name in rules if name not in filled]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightError(f"{source}: missing tensor(s) {', '.join(missing[:5])}{more}")
    return nest(buffers)


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


def abstract_model(cfg: ModelConfig, dtype, attention_backend: str = "reference", mesh=None):
    """The model with ShapeDtypeStruct leaves: no memory, no random init."""
    return nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0),
                                        attention_backend=attention_backend, mesh=mesh))


def place(params: dict, shardings: dict | None) -> dict:
    """Host arrays onto devices: whole onto the default device, or each device receiving
    only its own shard (also across processes: every process fills its own devices)."""
    if shardings is None:
        return jax.tree.map(jax.device_put, params)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
        params, shardings)


def build_model(cfg: ModelConfig, params: dict, dtype,
                attention_backend: str = "reference", mesh=None) -> Llama:
    """Put host parameters on the device(s) and bind them to a model; with a tensor-parallel
    `mesh`, `cfg` and `params` are the sharded ones (see models/sharding.py)."""
    from models.sharding import param_shardings

    graphdef, state = nnx.split(abstract_model(cfg, dtype, attention_backend, mesh))
    shardings = None if mesh is None else param_shardings(cfg, mesh)
    nnx.replace_by_pure_dict(state, place(params, shardings))
    return nnx.merge(graphdef, state)


def random_model(cfg: ModelConfig, dtype, *, seed: int = 0, attention_backend: str = "reference",
                 mesh=None) -> Llama:
    """Random weights of real shapes (benchmarks without the weights), made on the devices,
    directly in their shardings under a tensor-parallel `mesh`."""
    from models.sharding import param_shardings, sharded_config
    from ops.attention import TENSOR_AXIS

    run_cfg = cfg if mesh is None else sharded_config(cfg, mesh.shape[TENSOR_AXIS])
    init = lambda: nnx.to_pure_dict(nnx.state(Llama(run_cfg, dtype=dtype, rngs=nnx.Rngs(seed))))
    shardings = None if mesh is None else param_shardings(run_cfg, mesh)
    graphdef, state = nnx.split(abstract_model(run_cfg, dtype, attention_backend, mesh))
    nnx.replace_by_pure_dict(state, jax.jit(init, out_shardings=shardings)())
    return nnx.merge(graphdef, state)
