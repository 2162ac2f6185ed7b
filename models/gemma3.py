"""Gemma 3 (text): how it differs from Llama.

- Every norm scales by (1 + w), computed in float32 (llama.cpp's converter stores w + 1;
  `from_gguf` takes the 1 back off, as transformers does).
- Four norms per layer: before and after attention, before and after the MLP, each output
  normed before it joins the residual; queries and keys normed per head before RoPE.
- Sliding-window layers (five to one full layer, `layer_types`) with their own RoPE base.
- The softmax scale comes from `query_pre_attn_scalar`.
- GeGLU with tanh GELU; embeddings scaled by sqrt(hidden) in the weights' dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import FULL, SLIDING, ModelConfig, rope_scaling_from
from models.llama import Llama
from models.parameters import ParamSpec
from ops.invariant import mean_square

NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")
GGUF_SWA_PERIOD = 6          # llama.cpp's gemma3: every sixth layer is full
GGUF_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's gemma3: the sliding layers' RoPE base


class Gemma3(Llama):
    @classmethod
    def float_specs(cls, cfg: ModelConfig) -> dict[str, ParamSpec]:
        specs = super().float_specs(cfg)
        L, E, D = cfg.num_layers, cfg.hidden_size, cfg.head_dim
        specs |= {f"layers.{name}": ParamSpec((L, E), ("layers", "embed")) for name in NORMS}
        specs |= {f"layers.{name}": ParamSpec((L, D), ("layers", "head_dim"))
                  for name in ("q_norm", "k_norm")}
        specs["final_norm"] = ParamSpec((E,), ("embed",))
        # A norm's weight is its offset from 1: zero at initialization, as in HF.
        return {name: (dataclasses.replace(s, init="zeros") if "norm" in name else s)
                for name, s in specs.items()}

    @classmethod
    def layer_tensors(cls, cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
        E, D = cfg.hidden_size, cfg.head_dim
        tensors = super().layer_tensors(cfg)
        return tensors | {
            "post_attention_layernorm.weight": ("post_attn_norm", (E,)),
            "pre_feedforward_layernorm.weight": ("mlp_norm", (E,)),
            "post_feedforward_layernorm.weight": ("post_mlp_norm", (E,)),
            "self_attn.q_norm.weight": ("q_norm", (D,)),
            "self_attn.k_norm.weight": ("k_norm", (D,)),
        }

    @classmethod
    def gguf_layer_names(cls) -> dict[str, str]:
        return super().gguf_layer_names() | {
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
            "attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight",
        }

    @classmethod
    def from_gguf(cls, hf_name: str, w):
        return w - 1 if hf_name.endswith("norm.weight") else w

    @classmethod
    def scale_norm(cls, w, s):
        return (1 + w) / s - 1  # the norm scales by (1 + w)

    def embed_tokens(self, top, tokens):
        x = super().embed_tokens(top, tokens)
        return x * jnp.asarray(self.cfg.hidden_size ** 0.5, x.dtype)

    def norm(self, x, w):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(mean_square(xf) + self.cfg.rms_norm_eps)
        return (xf * (1.0 + w.astype(jnp.float32))).astype(self.dtype)

    def qk_norm(self, q, k, p):
        return self.norm(q, p["q_norm"]), self.norm(k, p["k_norm"])

    def layer(self, x, cache, p, idx, kind, step):
        attn, cache = self.attention(self.norm(x, p["attn_norm"]), cache, p, idx, kind, step)
        x = x + self.norm(attn, p["post_attn_norm"])
        mlp = self.mlp(self.norm(x, p["mlp_norm"]), p)
        return x + self.norm(mlp, p["post_mlp_norm"]), cache

    def activation(self, x):
        return jax.nn.gelu(x, approximate=True)


Model = Gemma3


def config_fields(hf: dict | None = None, gguf: dict | None = None) -> dict:
    if hf is not None:
        return _hf_fields(hf)
    return _gguf_fields(gguf)


def _hf_fields(hf: dict) -> dict:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"Gemma 3 with {key} is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with bidirectional attention is not supported")
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 with hidden_activation {act!r} is not supported")
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        period = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        types = [FULL if (i + 1) % period == 0 else SLIDING for i in range(layers)]
    # transformers 5 nests RoPE by layer type; earlier configs have flat keys.
    rope = hf.get("rope_parameters") or {}
    full = rope.get(FULL) or hf.get("rope_scaling") or {}
    local = rope.get(SLIDING) or {}
    scalar = hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256
    return dict(
        layer_types=tuple(types),
        sliding_window=hf["sliding_window"],
        rope_theta=float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
        rope_scaling=rope_scaling_from(full),
        rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
        attention_scale=float(scalar) ** -0.5,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _gguf_fields(meta: dict) -> dict:
    """llama.cpp's gemma3 reader hard-codes what the GGUF does not store: the layer pattern,
    the local RoPE base, and the 27B model's softmax scale (hidden / heads, not head_dim)."""
    layers = meta["gemma3.block_count"]
    heads = meta["gemma3.attention.head_count"]
    head_dim = meta.get("gemma3.attention.key_length", meta["gemma3.embedding_length"] // heads)
    scalar = meta["gemma3.embedding_length"] // heads if layers == 62 else head_dim
    return dict(
        layer_types=tuple(FULL if (i + 1) % GGUF_SWA_PERIOD == 0 else SLIDING
                          for i in range(layers)),
        sliding_window=int(meta["gemma3.attention.sliding_window"]),
        rope_local_theta=GGUF_LOCAL_ROPE_BASE,
        attention_scale=float(scalar) ** -0.5,
    )
