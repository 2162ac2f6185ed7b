"""Starting engines for serving: which model files, under which names, with how many KV pages.

The server's command line comes here (it never imports models/ or jax itself):
`parse_model_arg` reads `--model [name=]path`, and `start_engines` sizes each KV cache
(`device.size_kv`) and loads and warms up one AsyncEngine per model.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from engine.async_engine import AsyncEngine, Engines
from engine.config import EngineConfig
from engine.device import size_kv
from models.known_models import KNOWN_MODELS, fetch_model, served_name

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str


def parse_model_arg(value: str | None) -> ModelSpec:
    """`path`, `name=path`, a known model's name (models/known_models.py: fetched if
    missing), or None for the default model."""
    if value is None or value in KNOWN_MODELS:
        path = fetch_model(*([value] if value else []))
        return ModelSpec(served_name(path), str(path))
    name, sep, path = value.partition("=")
    if not sep or "/" in name or Path(value).exists():
        name, path = "", value
    if not Path(path).exists():
        raise FileNotFoundError(f"--model {value}: {path} does not exist")
    if not name:
        p = Path(path)
        name = served_name(p) or (p.stem if p.is_file() else p.name)
    return ModelSpec(name, path)


def start_engines(specs: list[ModelSpec], memory_fraction: float | None = None,
                  kv_memory_bytes: int | None = None, **engine_options) -> Engines:
    """Load and warm up one engine per model (in order); returns them by served name.
    `memory_fraction`, `kv_memory_bytes`: the KV pool's budget (engine.device.size_kv)."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"served model names must be unique, got {names}")
    engines = {}
    for spec in specs:
        config = EngineConfig(model=spec.path, name=spec.name, **engine_options)
        config = size_kv(config, memory_fraction, len(specs), kv_memory_bytes)
        logger.info("Loading %s from %s", spec.name, spec.path)
        engines[spec.name] = AsyncEngine(config)
    return Engines(engines)
