"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) in Flax NNX.

Every parameter is described once in `param_specs` (shape, logical axes, init);
the module, the abstract shapes used by the loaders and the weight-name maps all
derive from that table. Layers are stacked on a leading axis and run under
`lax.scan`, so compile time does not grow with depth. The forward pass is one
ragged batch of tokens over the paged KV cache (see ops/attention.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.rope import apply_rope, rope_inv_freq
from ops.attention import (
    AttentionMetadata,
    KVCache,
    ragged_paged_attention,
    resolve_backend,
    write_kv,
)
from ops.quantization import SCALE_DTYPE, QuantFormat, embedding, linear


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


def param_specs(cfg: ModelConfig, quant: dict[str, QuantFormat] | None = None
                ) -> dict[str, ParamSpec]:
    """Our parameter names -> spec. `layers.*` carry a leading [L] axis. A matrix quantized
    as `quant[name]` becomes `name` (integer values), `name_scale` and maybe `name_min`."""
    L, E, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    specs = {
        "embed": ParamSpec((V, E), ("vocab", "embed")),
        "layers.attn_norm": ParamSpec((L, E), ("layers", "embed"), "ones"),
        "layers.wq": ParamSpec((L, H * D, E), ("layers", "heads", "embed")),
        "layers.wk": ParamSpec((L, K * D, E), ("layers", "kv_heads", "embed")),
        "layers.wv": ParamSpec((L, K * D, E), ("layers", "kv_heads", "embed")),
        "layers.wo": ParamSpec((L, E, H * D), ("layers", "embed", "heads")),
        "layers.mlp_norm": ParamSpec((L, E), ("layers", "embed"), "ones"),
        "layers.w_gate": ParamSpec((L, F, E), ("layers", "mlp", "embed")),
        "layers.w_up": ParamSpec((L, F, E), ("layers", "mlp", "embed")),
        "layers.w_down": ParamSpec((L, E, F), ("layers", "embed", "mlp")),
        "final_norm": ParamSpec((E,), ("embed",), "ones"),
    }
    if cfg.attention_bias:
        specs["layers.bq"] = ParamSpec((L, H * D), ("layers", "heads"), "zeros")
        specs["layers.bk"] = ParamSpec((L, K * D), ("layers", "kv_heads"), "zeros")
        specs["layers.bv"] = ParamSpec((L, K * D), ("layers", "kv_heads"), "zeros")
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((V, E), ("vocab", "embed"))
    for name, fmt in (quant or {}).items():
        if name not in specs or name not in QUANTIZABLE:
            raise ValueError(f"{name!r} is not a quantizable parameter of this model")
        spec = specs[name]
        scale_shape = (*spec.shape[:-1], fmt.scale_columns(spec.shape[-1]))
        specs[name] = dataclasses.replace(spec, init="zeros", dtype=fmt.storage_dtype())
        # Group scales split with their inputs; one scale per row is the same on every shard.
        axes = spec.axes if fmt.group else (*spec.axes[:-1], "row_scale")
        specs[name + "_scale"] = ParamSpec(scale_shape, axes, "ones", SCALE_DTYPE)
        if fmt.has_min:
            specs[name + "_min"] = ParamSpec(scale_shape, axes, "zeros", SCALE_DTYPE)
    return specs


def _init(spec: ParamSpec, key, dtype):
    dtype = spec.dtype or dtype
    if spec.init == "ones":
        return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, dtype)
    return (0.02 * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)


def weight(params: dict, name: str):
    """A matrix as `linear` takes it: the float array, or its quantized parts."""
    if name + "_scale" not in params:
        return params[name]
    parts = {"q": params[name], "scale": params[name + "_scale"]}
    if name + "_min" in params:
        parts["min"] = params[name + "_min"]
    return parts


class _Stack(nnx.Module):
    """The per-layer parameters, each with a leading [L] axis."""

    def __init__(self, params: dict[str, nnx.Param]):
        for name, p in params.items():
            setattr(self, name, p)


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str = "reference", mesh=None,
                 quant: dict[str, QuantFormat] | None = None):
        self.cfg = cfg
        self.dtype = dtype  # activations (and float weights)
        self.quant = tuple(sorted((quant or {}).items()))  # (parameter name, format) pairs
        self.attention_backend = resolve_backend(attention_backend)  # "auto" -> the platform's
        self.mesh = mesh  # a tensor-parallel mesh (models/sharding.py), or None
        params = {name: nnx.Param(_init(spec, rngs.params(), dtype))
                  for name, spec in param_specs(cfg, quant).items()}
        self.top_names = tuple(n for n in params if not n.startswith("layers."))
        for name in self.top_names:  # embed, final_norm, lm_head (and their quantization parts)
            setattr(self, name, params.pop(name))
        self.layers = _Stack({name.removeprefix("layers."): p for name, p in params.items()})

    def __call__(
        self,
        tokens: jax.Array,      # [T] int32
        positions: jax.Array,   # [T] int32
        cache: KVCache,
        md: AttentionMetadata,
        logits_indices: jax.Array | None = None,  # [N] rows whose logits are wanted
    ) -> tuple[jax.Array, KVCache]:  # logits [T or N, V] float32
        x, cache = self.hidden_states(tokens, positions, cache, md, logits_indices)
        return self.logits(x), cache

    def hidden_states(
        self,
        tokens: jax.Array,      # [T] int32
        positions: jax.Array,   # [T] int32
        cache: KVCache,
        md: AttentionMetadata,
        logits_indices: jax.Array | None = None,  # [N] rows whose states are wanted
    ) -> tuple[jax.Array, KVCache]:  # final-normed states [T or N, E]
        """The model body: embeddings and every layer, updating the cache."""
        cfg = self.cfg
        T, H, K, D = tokens.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        top = self.top_params()
        x = embedding(weight(top, "embed"), tokens, self.dtype)  # [T, E]
        inv_freq = rope_inv_freq(cfg)
        layer_params = nnx.to_pure_dict(nnx.state(self.layers))
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)

        def layer(carry, xs):
            x, cache = carry
            p, idx = xs
            h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            lin = functools.partial(linear, chunked=self.mesh is None)
            q, k, v = (lin(h, weight(p, w)) for w in ("wq", "wk", "wv"))
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q, k, v = q.reshape(T, H, D), k.reshape(T, K, D), v.reshape(T, K, D)
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
            cache = write_kv(cache, idx, k, v, md.slot_mapping, mesh=self.mesh)
            attn = ragged_paged_attention(
                q, cache, idx, md, sm_scale=cfg.head_dim ** -0.5,
                sliding_window=cfg.sliding_window, backend=self.attention_backend,
                mesh=self.mesh)
            x = x + lin(attn.reshape(T, H * D), weight(p, "wo"))
            h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            gate = jax.nn.silu(lin(h, weight(p, "w_gate")))
            x = x + lin(gate * lin(h, weight(p, "w_up")), weight(p, "w_down"))
            return (x, cache), None

        (x, cache), _ = jax.lax.scan(layer, (x, cache), (layer_params, layer_ids))
        if logits_indices is not None:
            x = x[logits_indices]
        return rms_norm(x, top["final_norm"], self.cfg.rms_norm_eps), cache

    def logits(self, x: jax.Array) -> jax.Array:  # [N, E] final-normed -> [N, V] float32
        """The LM head."""
        head = "embed" if self.cfg.tie_word_embeddings else "lm_head"
        return linear(x, weight(self.top_params(), head), jnp.float32,
                      chunked=self.mesh is None)

    def top_params(self) -> dict:
        """The parameters outside the layer stack (embeddings, final norm, LM head)."""
        return {name: getattr(self, name)[...] for name in self.top_names}


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As in HF: normalise in float32, cast back, then scale.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)
