"""GGUF weights: llama.cpp tensor names -> HF names, dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of Llama's Q and K projections (to interleave
rotary pairs); we undo it so the weights are in the HF rotate-half layout.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from models.config import ModelConfig
from models.gguf_file import GGUFError, open_gguf, read_metadata
from models.weights import WeightError, assemble_params

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def gguf_config(path: str | Path) -> ModelConfig:
    reader = open_gguf(path)
    names = {t.name: t for t in reader.tensors}
    factors = None
    if "rope_freqs.weight" in names:  # Llama 3.1 scaling, baked by llama.cpp's converter
        factors = tuple(float(x) for x in reader.values(names["rope_freqs.weight"]).ravel())
    try:
        return ModelConfig.from_gguf_metadata(read_metadata(path), set(names), factors)
    except ValueError as e:
        raise GGUFError(f"{path}: {e}") from e


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows [n, D/2, 2] (interleaved) -> [n, 2, D/2]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_params(path: str | Path, cfg: ModelConfig, dtype) -> dict:
    reader = open_gguf(path)
    permuted = cfg.architecture == "LlamaForCausalLM"  # llama.cpp permutes Q/K for llama only

    def loader(tensor):
        def load():
            w = gguf.dequantize(reader.raw(tensor), tensor.tensor_type)
            expected = int(np.prod(tensor.shape))
            if w.size != expected:
                raise WeightError(f"{path}: tensor {tensor.name!r} holds {w.size} values, "
                                  f"expected {expected} (truncated file?)")
            w = w.reshape(tuple(reversed(tensor.shape)))
            if permuted and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
                w = unpermute_rows(w, cfg.num_heads)
            elif permuted and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
                w = unpermute_rows(w, cfg.num_kv_heads)
            return w
        return load

    items = []
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                continue
            raise WeightError(f"{path}: unexpected tensor {tensor.name!r}")
        items.append((name, tensor.name, loader(tensor)))
    return assemble_params(cfg, items, source=str(path), dtype=dtype, total=len(items))
