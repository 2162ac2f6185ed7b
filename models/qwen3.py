"""Qwen3 (dense): Llama with an RMS norm over head_dim on every query and key head before
RoPE, and an explicit head_dim (not hidden / heads; config.py reads it for every family)."""

from __future__ import annotations

from models.config import ModelConfig
from models.llama import Llama, rms_norm
from models.parameters import ParamSpec


class Qwen3(Llama):
    @classmethod
    def float_specs(cls, cfg: ModelConfig) -> dict[str, ParamSpec]:
        specs = super().float_specs(cfg)
        L, D = cfg.num_layers, cfg.head_dim
        for name in ("q_norm", "k_norm"):
            specs[f"layers.{name}"] = ParamSpec((L, D), ("layers", "head_dim"), "ones")
        return specs

    @classmethod
    def layer_tensors(cls, cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
        D = cfg.head_dim
        return super().layer_tensors(cfg) | {"self_attn.q_norm.weight": ("q_norm", (D,)),
                                             "self_attn.k_norm.weight": ("k_norm", (D,))}

    @classmethod
    def gguf_layer_names(cls) -> dict[str, str]:
        return super().gguf_layer_names() | {"attn_q_norm.weight": "self_attn.q_norm.weight",
                                             "attn_k_norm.weight": "self_attn.k_norm.weight"}

    def qk_norm(self, q, k, p):
        eps = self.cfg.rms_norm_eps
        return rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)


Model = Qwen3


def config_fields(hf: dict | None = None, gguf: dict | None = None) -> dict:
    if hf is not None and hf.get("use_sliding_window"):
        raise ValueError("Qwen3 with use_sliding_window is not supported")
    return {}
