"""GGUF weights: llama.cpp tensor names -> HF names; blocks kept or dequantized.

Q8_0, Q4_0 and Q4_1 blocks are exactly our group-32 formats (ops/quantization.py): under
`--quantization` they are taken over value for value, straight from the file's bytes. Every
other tensor, and every tensor when no quantization is asked for, is dequantized with the
`gguf` package. llama.cpp's converter permutes the rows of Llama's Q and K projections (to
interleave rotary pairs); we undo it so the weights are in the HF rotate-half layout.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from models import registry
from models.config import ModelConfig
from models.gguf_file import GGUFError, open_gguf, read_metadata
from models.registry import model_class
from models.weights import WeightError, assemble_params, hf_tensor_rules, quant_plan
from ops.quantization import QuantFormat

# GGUF block types that are our formats: type -> (format, bytes per block of 32 values).
KEPT = {
    gguf.GGMLQuantizationType.Q8_0: (QuantFormat(8, 32), 34),        # f16 d, 32 x int8
    gguf.GGMLQuantizationType.Q4_0: (QuantFormat(4, 32), 18),        # f16 d, 16 B of nibbles
    gguf.GGMLQuantizationType.Q4_1: (QuantFormat(4, 32, True), 20),  # f16 d, f16 m, nibbles
}

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


def repack(raw: np.ndarray, tensor_type, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """A Q8_0 / Q4_0 / Q4_1 tensor's bytes -> {"q": int8 [O, I], "scale" (and "min"):
    float16 [O, I / 32], as stored}, with `w = q * scale (+ min)` equal to the gguf package's
    dequantization bit for bit. The values never pass through a float."""
    fmt, block_bytes = KEPT[tensor_type]
    *lead, cols = shape
    blocks = raw.reshape(-1, block_bytes)
    f16 = lambda lo, hi: np.ascontiguousarray(blocks[:, lo:hi]).view(np.float16)
    groups = (*lead, cols // 32)
    if fmt.bits == 8:
        q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
    else:  # nibbles: byte j holds value j (low) and value j + 16 (high) of the block
        nibbles = blocks[:, -16:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int8)
        if not fmt.has_min:
            q -= 8  # Q4_0: w = d * (nibble - 8)
    out = {"q": q.reshape(shape), "scale": f16(0, 2).reshape(groups)}
    if fmt.has_min:
        out["min"] = f16(2, 4).reshape(groups)
    return out


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
            stored.setdefault(rule.target, set()).add(KEPT.get(tensor.tensor_type, (None,))[0])
    quant = quant_plan(cfg, quantization, stored)

    def loader(tensor, name, target):
        def load():
            shape = tuple(reversed(tensor.shape))
            raw = reader.raw(tensor)
            expected = int(np.prod(shape))
            kept = KEPT.get(tensor.tensor_type)
            if kept is not None and quant.get(target) == kept[0]:
                if raw.size * 32 != expected * kept[1]:
                    raise WeightError(f"{path}: tensor {tensor.name!r} has {raw.size} bytes, "
                                      f"expected {expected * kept[1] // 32} (truncated file?)")
                w = repack(raw, tensor.tensor_type, shape)
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
