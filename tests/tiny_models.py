"""Tiny random HF models on disk (safetensors + a word-level tokenizer.json) for the tensor
parallel and multi-host tests: 8 heads, so every size up to 8 divides them."""

from __future__ import annotations

from pathlib import Path


def save_tiny_hf(path: Path, *, qwen2: bool = False, **extra) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    cls = transformers.Qwen2Config if qwen2 else transformers.LlamaConfig
    config = cls(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=8, max_position_embeddings=512, initializer_range=0.3,
                 rms_norm_eps=1e-6, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path
