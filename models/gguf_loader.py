"""GGUF weights: llama.cpp tensor names -> HF names; blocks kept or dequantized.

Under `--quantization auto` (and any weight-only scheme of at least their bits) the blocks of
the types models/gguf_blocks.py holds (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) are
taken over straight from the file's bytes, in one format per stacked parameter. Every other
tensor, and every tensor when no quantization is asked for, is dequantized with the `gguf`
package. llama.cpp's converter permutes the rows of Llama's Q and K projections (to
interleave rotary pairs); we undo it so the weights are in the HF rotate-half layout.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from models import registry
from models.config import ModelConfig
from models.gguf_blocks import KEPT, holds, repack, widen
from models.gguf_file import GGUFError, open_gguf, read_metadata
from models.registry import model_class
from models.weights import WeightError, assemble_params, hf_tensor_rules, quant_plan

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
    """llama.cpp's name -> HF's; `layer_names`: the family's (`Model.gguf_layer_names`)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
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


def load_gguf_params(path: str | Path, cfg: ModelConfig, dtype,
                     quantization: str | None = None) -> tuple[dict, dict]:
    """(parameters on the host, the quantization plan: models/weights.py quant_plan)."""
    reader = open_gguf(path)
    family = model_class(cfg.architecture)
    layer_names = family.gguf_layer_names()
    permuted = cfg.architecture in registry.family(cfg.architecture).gguf_permuted_qk
    rules = hf_tensor_rules(cfg)
    stored: dict[str, set] = {}
    for tensor in reader.tensors:
        rule = rules.get(hf_name(tensor.name, layer_names) or "")
        if rule is not None:
            stored.setdefault(rule.target, set()).add(KEPT.get(tensor.tensor_type))
    quant = quant_plan(cfg, quantization, stored)

    def loader(tensor, name, target):
        def load():
            shape = tuple(reversed(tensor.shape))
            raw = reader.raw(tensor)
            expected = int(np.prod(shape))
            fmt = quant.get(target)
            if tensor.tensor_type in KEPT and holds(fmt, KEPT[tensor.tensor_type]):
                try:
                    w = widen(repack(raw, tensor.tensor_type, shape), fmt)
                except ValueError as e:
                    raise WeightError(f"{path}: tensor {tensor.name!r}: {e}") from e
            else:
                w = gguf.dequantize(raw, tensor.tensor_type)
                if w.size != expected:
                    raise WeightError(f"{path}: tensor {tensor.name!r} holds {w.size} values, "
                                      f"expected {expected} (truncated file?)")
                w = w.reshape(shape)
            heads = None
            if permuted and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
                heads = cfg.num_heads
            elif permuted and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
                heads = cfg.num_kv_heads
            if heads is not None:
                w = ({k: unpermute_rows(v, heads) for k, v in w.items()} if isinstance(w, dict)
                     else unpermute_rows(w, heads))
            return w if isinstance(w, dict) else family.from_gguf(name, w)
        return load

    items = []
    for tensor in reader.tensors:
        name = hf_name(tensor.name, layer_names)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                continue
            raise WeightError(f"{path}: unexpected tensor {tensor.name!r}")
        rule = rules.get(name)
        items.append((name, tensor.name, loader(tensor, name, rule.target if rule else None)))
    return assemble_params(cfg, items, source=str(path), dtype=dtype, quant=quant,
                           total=len(items)), quant
