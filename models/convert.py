"""Convert a GGUF file or HF directory into an xlaserve Orbax checkpoint (see checkpoint.py)."""

from __future__ import annotations

from pathlib import Path

from models import checkpoint
from models.loader import load_config, load_host_params, resolve_dtype
from models.tokenizer import Tokenizer


def convert(src: str | Path, dst: str | Path, dtype: str = "float32",
            quantization: str | None = None) -> Path:
    jdtype = resolve_dtype(dtype)
    cfg = load_config(src)
    params, quant = load_host_params(src, cfg, jdtype, quantization)
    dst = Path(dst)
    Tokenizer.for_model(src).save_pretrained(dst)
    checkpoint.save_checkpoint(dst, cfg, params, jdtype, quant)
    return dst
