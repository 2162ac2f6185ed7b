"""ModelConfig: the shape of a Llama-family decoder, from HF config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# HF `architectures` entries this decoder implements (all are Llama-shaped).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# GGUF `general.architecture` values and the HF architecture they mean.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors as llama.cpp stores them (`rope_freqs.weight`, Llama 3.1 GGUFs).
    rope_freq_factors: tuple[float, ...] | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries, "
                             f"expected head_dim / 2 = {self.head_dim // 2}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        # Qwen2 always has q/k/v biases; Llama has them when `attention_bias` says so.
        bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch ==
                                                      "MistralForCausalLM") else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            rope_scaling=_rope_scaling(rope_params),
            sliding_window=window,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            return cls.from_hf_dict(json.loads(file.read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"{file}: no config.json in the model directory") from None
        except KeyError as e:
            raise ValueError(f"{file}: missing key {e}") from None

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str],
                           rope_freq_factors: tuple[float, ...] | None = None) -> ModelConfig:
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)}")

        def get(key, default=None):
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return value

        hidden = get("embedding_length")
        num_heads = get("attention.head_count")
        vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
        if meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
            raise ValueError(f"unsupported GGUF rope scaling "
                             f"{meta[f'{arch}.rope.scaling.type']!r}")
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=num_heads,
            num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", num_heads),
            head_dim=meta.get(f"{arch}.attention.key_length", hidden // num_heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=get("context_length"),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            rope_freq_factors=rope_freq_factors,
            sliding_window=None,
        )


def _rope_scaling(params: dict[str, Any]) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: llama3)")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
