"""HF safetensors directories: a single `model.safetensors` or a sharded index."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from models.config import ModelConfig
from models.weights import WeightError, assemble_params, quant_plan


def safetensors_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise WeightError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({directory / f for f in weight_map.values()})
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise WeightError(f"{index}: lists shard(s) that do not exist: {', '.join(absent)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{directory}: no *.safetensors files")
    return files


def load_hf_params(directory: str | Path, cfg: ModelConfig, dtype,
                   quantization: str | None = None) -> tuple[dict, dict]:
    """(parameters on the host, the quantization plan: models/weights.py quant_plan)."""
    quant = quant_plan(cfg, quantization)
    files = safetensors_files(directory)
    items = []
    for file in files:
        try:
            # The numpy backend cannot read bfloat16; the flax one can (held on the host CPU).
            f = safe_open(str(file), framework="flax")
        except (SafetensorError, OSError) as e:
            raise WeightError(f"{file}: cannot open safetensors file ({e})") from e
        for name in f.keys():
            items.append((name, f"{name} in {file.name}", lambda f=f, n=name: _host(f, n)))
    return assemble_params(cfg, items, source=str(directory), dtype=dtype, quant=quant,
                           total=len(items)), quant


def _host(handle, name: str) -> np.ndarray:
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # this process's CPU
        return np.asarray(handle.get_tensor(name))
