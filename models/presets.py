"""Named model shapes for random-weight runs (benchmarks on machines without the weights)."""

from __future__ import annotations

from models.config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500000.0, max_position_embeddings=131072,
                         tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE | {"factor": 32.0}),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=500000.0, max_position_embeddings=8192,
                       tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 tie_word_embeddings=True),
}


def preset_config(name: str) -> ModelConfig:
    try:
        fields = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose from "
                         f"{', '.join(PRESETS)}") from None
    return ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"],
                                     "rms_norm_eps": 1e-5, **fields})
