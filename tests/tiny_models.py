"""Tiny random HF models on disk (safetensors + a word-level tokenizer.json) for the tensor
parallel, multi-host and model-family tests: 8 heads, so every size up to 8 divides them."""

from __future__ import annotations

from pathlib import Path

CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "gemma3": "Gemma3TextConfig"}
# Gemma 3's own shape: sliding and full layers (a window shorter than the tests' prompts),
# each kind with its RoPE base, and a softmax scale other than head_dim's. Its head is
# untied: random embeddings scaled by sqrt(hidden) and tied make greedy repeat the input.
GEMMA3 = dict(tie_word_embeddings=False, num_hidden_layers=3, head_dim=64, sliding_window=8,
              query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 1e4}})


def save_tiny_hf(path: Path, *, family: str = "llama", **extra) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    cls = getattr(transformers, CONFIGS[family])
    shape = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=8, max_position_embeddings=512, initializer_range=0.3,
                 rms_norm_eps=1e-6)
    config = cls(**(shape | (GEMMA3 if family == "gemma3" else {}) | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # Gemma's norms start at 0 (a factor of 1); make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path
