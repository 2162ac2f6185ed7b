"""Logits parity with transformers on tiny random-weight models saved as safetensors.

Prefill logits and token-by-token decode through our paged KV cache must both be
within 1e-4 (float32) of transformers' full forward pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch  # the dev extra: a missing reference fails, never skips
import transformers

from models.generate import GreedyDecoder
from models.loader import load_model

TOL = 1e-4

COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
              max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6)

CONFIGS = {
    # plain multi-head attention, untied head
    "llama-mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4,
                                      tie_word_embeddings=False)),
    # GQA 4:1, tied embeddings, Llama 3 rope scaling, explicit head_dim
    "llama3-gqa-tied": ("LlamaConfig", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=32))),
    # GQA 2:1 with a sliding window shorter than the test sequence
    "mistral-gqa-window": ("MistralConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=7,
        tie_word_embeddings=False)),
    # q/k/v biases, GQA, tied embeddings
    "qwen2-bias-tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=True)),
    # Qwen3: per-head q/k RMS norms, head_dim not hidden / heads
    "qwen3-qknorm": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=24, tie_word_embeddings=True)),
    # Gemma 3: (1 + w) norms, four per layer, GeGLU, scaled embeddings, sliding and full
    # layers with their own RoPE bases (a window shorter than the test sequence; three
    # layers make one period of two and one layer past it), query_pre_attn_scalar
    "gemma3-swa": ("Gemma3TextConfig", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=20, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
}


def _save_tiny(kind: str, tmp_path_factory, shards: bool = False):
    cls_name, extra = CONFIGS[kind]
    config = getattr(transformers, cls_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # norms and biases start at 1/0; make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path, safe_serialization=True,
                          max_shard_size="200KB" if shards else "1GB")
    return model, path


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    return request.param, *_save_tiny(request.param, tmp_path_factory)


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_prefill_logits_match(tiny):
    kind, hf, path = tiny
    ids = list(np.random.default_rng(1).integers(0, COMMON["vocab_size"], 29))
    ref = _hf_logits(hf, ids)
    assert ref.std() > 0.5, "logits too small for the tolerance to mean anything"
    ours = GreedyDecoder(load_model(path, dtype="float32")).prompt_logits(ids)
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_decode_through_kv_cache_matches(tiny):
    kind, hf, path = tiny
    ids = [int(x) for x in np.random.default_rng(2).integers(0, COMMON["vocab_size"], 40)]
    ref = _hf_logits(hf, ids)
    dec = GreedyDecoder(load_model(path, dtype="float32"), max_len=64, page_size=8)
    cache = dec.new_cache()
    logits, cache = dec.run(cache, ids[:11], 0)  # prefill crosses a page boundary
    np.testing.assert_allclose(logits, ref[10], atol=TOL, rtol=0)
    for pos in range(11, len(ids)):  # then one token per step
        logits, cache = dec.run(cache, [ids[pos]], pos)
        np.testing.assert_allclose(logits, ref[pos], atol=TOL, rtol=0, err_msg=f"pos {pos}")


def test_sharded_safetensors_index(tmp_path_factory):
    hf, path = _save_tiny("llama-mha", tmp_path_factory, shards=True)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    ids = [3, 17, 99, 4, 150, 8]
    ours = GreedyDecoder(load_model(path, dtype="float32")).prompt_logits(ids)
    np.testing.assert_allclose(ours, _hf_logits(hf, ids), atol=TOL, rtol=0)
