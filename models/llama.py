"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) in Flax NNX.

Every parameter is described once in `param_specs` (shape, logical axes, init);
the module, the abstract shapes used by the loaders and the weight-name maps all
derive from that table. Layers are stacked on a leading axis and run under
`lax.scan`, so compile time does not grow with depth. The forward pass is one
ragged batch of tokens over the paged KV cache (see ops/attention.py).
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per dim
    init: str = "normal"   # "normal" | "ones" | "zeros"


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Our parameter names -> spec. `layers.*` carry a leading [L] axis."""
    L, E, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    specs = {
        "embed": ParamSpec((V, E), ("vocab", "embed")),
        "layers.attn_norm": ParamSpec((L, E), ("layers", "embed"), "ones"),
        "layers.wq": ParamSpec((L, E, H, D), ("layers", "embed", "heads", "head_dim")),
        "layers.wk": ParamSpec((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim")),
        "layers.wv": ParamSpec((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim")),
        "layers.wo": ParamSpec((L, H, D, E), ("layers", "heads", "head_dim", "embed")),
        "layers.mlp_norm": ParamSpec((L, E), ("layers", "embed"), "ones"),
        "layers.w_gate": ParamSpec((L, E, F), ("layers", "embed", "mlp")),
        "layers.w_up": ParamSpec((L, E, F), ("layers", "embed", "mlp")),
        "layers.w_down": ParamSpec((L, F, E), ("layers", "mlp", "embed")),
        "final_norm": ParamSpec((E,), ("embed",), "ones"),
    }
    if cfg.attention_bias:
        specs["layers.bq"] = ParamSpec((L, H, D), ("layers", "heads", "head_dim"), "zeros")
        specs["layers.bk"] = ParamSpec((L, K, D), ("layers", "kv_heads", "head_dim"), "zeros")
        specs["layers.bv"] = ParamSpec((L, K, D), ("layers", "kv_heads", "head_dim"), "zeros")
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((E, V), ("embed", "vocab"))
    return specs


def _init(spec: ParamSpec, key, dtype):
    if spec.init == "ones":
        return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, dtype)
    return (0.02 * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)


class _Stack(nnx.Module):
    """The per-layer parameters, each with a leading [L] axis."""

    def __init__(self, params: dict[str, nnx.Param]):
        for name, p in params.items():
            setattr(self, name, p)


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str = "reference", mesh=None):
        self.cfg = cfg
        self.attention_backend = resolve_backend(attention_backend)  # "auto" -> the platform's
        self.mesh = mesh  # a tensor-parallel mesh (models/sharding.py), or None
        params = {name: nnx.Param(_init(spec, rngs.params(), dtype))
                  for name, spec in param_specs(cfg).items()}
        self.embed = params.pop("embed")
        self.final_norm = params.pop("final_norm")
        if not cfg.tie_word_embeddings:
            self.lm_head = params.pop("lm_head")
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
        x = self.embed[...][tokens]  # [T, E]
        inv_freq = rope_inv_freq(cfg)
        layer_params = nnx.to_pure_dict(nnx.state(self.layers))
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)

        def layer(carry, xs):
            x, cache = carry
            p, idx = xs
            h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            q = jnp.einsum("te,ehd->thd", h, p["wq"])
            k = jnp.einsum("te,ehd->thd", h, p["wk"])
            v = jnp.einsum("te,ehd->thd", h, p["wv"])
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
            cache = write_kv(cache, idx, k, v, md.slot_mapping, mesh=self.mesh)
            attn = ragged_paged_attention(
                q, cache, idx, md, sm_scale=cfg.head_dim ** -0.5,
                sliding_window=cfg.sliding_window, backend=self.attention_backend,
                mesh=self.mesh)
            x = x + jnp.einsum("thd,hde->te", attn, p["wo"])
            h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            gate = jax.nn.silu(h @ p["w_gate"])
            x = x + (gate * (h @ p["w_up"])) @ p["w_down"]
            return (x, cache), None

        (x, cache), _ = jax.lax.scan(layer, (x, cache), (layer_params, layer_ids))
        if logits_indices is not None:
            x = x[logits_indices]
        return rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps), cache

    def logits(self, x: jax.Array) -> jax.Array:  # [N, E] final-normed -> [N, V] float32
        """The LM head."""
        head = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return jnp.dot(x, head, preferred_element_type=jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As in HF: normalise in float32, cast back, then scale.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)
