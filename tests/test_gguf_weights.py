"""GGUF weights written the way llama.cpp's converter writes them load to the same model.

Tiny Llama, Qwen2, Qwen3 and Gemma 3 models from transformers are written as GGUF files
with `gguf.GGUFWriter` (llama.cpp names, F16/F32 tensors, Q/K rows permuted for the
llama architecture only and Gemma's norms stored as w + 1, as llama.cpp does) and must
give transformers' logits.
"""

from __future__ import annotations

import math

import gguf  # the dev extra: a missing reference fails, never skips
import numpy as np
import pytest
import torch
import transformers

from models.generate import GreedyDecoder
from models.loader import load_model

NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
GEMMA3_NAMES = NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to Llama's q/k rows.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def llama_cpp_rope_freqs(cfg) -> np.ndarray:
    # llama.cpp's converter turns Llama 3 rope scaling into per-frequency divisors.
    rs = cfg.rope_parameters
    theta, head_dim = rs["rope_theta"], cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    old, lo, hi, factor = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                           rs["high_freq_factor"], rs["factor"])
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(model, path, arch: str):
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    names = GEMMA3_NAMES if arch == "gemma3" else NAMES
    if arch in ("gemma3", "qwen3"):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    if (cfg.rope_parameters or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(cfg))
    for name, p in model.state_dict().items():
        w = p.numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{layer}.{names[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp stores Gemma's norm weights as the factor itself
        # Matrices in F16 (as most GGUF files), vectors in F32.
        writer.add_tensor(out, w.astype(np.float16) if w.ndim == 2 else w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, config_cls, extra", [
    ("llama", "LlamaConfig", dict(tie_word_embeddings=False)),
    ("llama", "LlamaConfig", dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    ("qwen2", "Qwen2Config", dict(tie_word_embeddings=True)),
    ("qwen3", "Qwen3Config", dict(tie_word_embeddings=False, head_dim=24)),
    # llama.cpp's gemma3 hard-codes a full layer every sixth (seven layers: one past the
    # period), the sliding layers' RoPE base 10000, and the softmax scale head_dim ** -0.5
    ("gemma3", "Gemma3TextConfig", dict(
        num_hidden_layers=7, head_dim=32, sliding_window=5, query_pre_attn_scalar=32,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
])
def test_gguf_file_gives_transformers_logits(tmp_path, arch, config_cls, extra):
    config = getattr(transformers, config_cls)(**({
        "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "initializer_range": 0.15} | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
            if p.ndim == 2:  # the file stores matrices in F16: compare on those values
                p.copy_(p.half().float())
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(model, path, arch)

    ids = [5, 17, 3, 88, 42, 42, 9, 60, 1, 33] * 5  # long enough for the scaling to matter
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    ours = GreedyDecoder(load_model(path, dtype="float32")).prompt_logits(ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
