"""ModelConfig: the shape of a decoder, from HF config.json or GGUF metadata.

The fields every family shares are read here; a family's own keys are read by its module
(`config_fields`, found through models/registry.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from models import registry

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's `layer_types` values


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling: Llama 3's (`rope_type: llama3`) or linear (every frequency divided
    by `factor`: Gemma 3's global layers)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: str = "llama3"


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
    # Per layer, HF's "sliding_attention" or "full_attention" (Gemma 3: five sliding layers
    # to one full); None: every layer alike, windowed when `sliding_window` is set.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of the sliding layers, if their own
    attention_scale: float | None = None   # softmax scale; None: head_dim ** -0.5

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
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}:
                raise ValueError(f"layer_types must give {SLIDING!r} or {FULL!r} for each of "
                                 f"the {self.num_layers} layers, got {self.layer_types}")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ValueError("sliding layers need a sliding_window")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return self.attention_scale or self.head_dim ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The attention window of one layer (None: the whole context)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        family = registry.module(arch)  # UnsupportedArchitecture (a ValueError) if unknown
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        # Qwen2 always has q/k/v biases; Llama has them when `attention_bias` says so.
        bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch ==
                                                      "MistralForCausalLM") else None
        fields = dict(
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
            rope_scaling=rope_scaling_from(rope_params),
            sliding_window=window,
        )
        return cls(**(fields | family.config_fields(hf=cfg)))

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
        _, hf_arch = registry.gguf_family(arch)  # UnsupportedArchitecture if unknown
        family = registry.module(hf_arch)

        def get(key, default=None):
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return value

        hidden = get("embedding_length")
        num_heads = get("attention.head_count")
        vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
        scaling = meta.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none", "linear"):
            raise ValueError(f"unsupported GGUF rope scaling {scaling!r}")
        fields = dict(
            architecture=hf_arch,
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
            rope_scaling=(RopeScaling(float(get("rope.scaling.factor")), kind="linear")
                          if scaling == "linear" else None),
            sliding_window=None,
        )
        return cls(**(fields | family.config_fields(gguf=meta)))


def rope_scaling_from(params: dict[str, Any]) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(factor=float(params["factor"]), kind="linear")
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: llama3, linear)")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
