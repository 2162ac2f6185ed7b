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
from engine.embedding_engine import EmbeddingEngine
from engine.sampling_params import SamplingParams, SamplingParamsError
from models.generation_config import generation_defaults, parse_overrides
from models.known_models import KNOWN_MODELS, fetch_model, served_name
from models.registry import model_kind

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str


def parse_model_arg(value: str | None) -> ModelSpec:
    """`path`, `name=path`, a known model's name (models/known_models.py: fetched if
    missing), `name=` a known model's name, or None for the default model."""
    if value is None or value in KNOWN_MODELS:
        path = fetch_model(*([value] if value else []))
        return ModelSpec(served_name(path), str(path))
    name, sep, path = value.partition("=")
    if not sep or "/" in name or Path(value).exists():
        name, path = "", value
    elif path in KNOWN_MODELS:  # NAME=a known model's name
        return ModelSpec(name, str(fetch_model(path)))
    if not Path(path).exists():
        raise FileNotFoundError(f"--model {value}: {path} does not exist")
    if not name:
        p = Path(path)
        name = served_name(p) or (p.stem if p.is_file() else p.name)
    return ModelSpec(name, path)


def sampling_defaults(spec: ModelSpec, generation_config: str = "auto",
                      overrides: dict | None = None) -> dict:
    """The sampling values a request to this model gets for the fields it leaves unset:
    the model's own (models.generation_config) under "auto", none under "vllm" (OpenAI's
    defaults then), and `overrides` over either (--override-generation-config)."""
    if generation_config not in ("auto", "vllm"):
        raise ValueError(f"--generation-config must be auto or vllm, got {generation_config!r}")
    values, source = (generation_defaults(spec.path) if generation_config == "auto"
                      else ({}, None))
    values = {**values, **(overrides or {})}
    try:
        SamplingParams(**values)
    except (SamplingParamsError, TypeError) as e:
        raise ValueError(f"{spec.name}'s sampling defaults {values}: {e}") from None
    if values:
        logger.info("%s: requests that leave them unset sample with %s (from %s)", spec.name,
                    ", ".join(f"{k} {v}" for k, v in values.items()),
                    " and ".join(filter(None, [source, "--override-generation-config"
                                               if overrides else None])))
    return values


def start_engines(specs: list[ModelSpec], memory_fraction: float | None = None,
                  kv_memory_bytes: int | None = None, generation_config: str = "auto",
                  generation_overrides: str | None = None, **engine_options) -> Engines:
    """Load and warm up one engine per model (in order); returns them by served name.
    `memory_fraction`, `kv_memory_bytes`: the KV pool's budget (engine.device.size_kv);
    `generation_config`, `generation_overrides` (a JSON object's text): the sampling
    defaults (sampling_defaults)."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"served model names must be unique, got {names}")
    overrides = parse_overrides(generation_overrides)
    task = engine_options.pop("task", "auto")
    tasks = {s.name: model_task(s, task) for s in specs}
    defaults = {s.name: sampling_defaults(s, generation_config, overrides)
                for s in specs if tasks[s.name] == "generate"}  # (before any model loads)
    generators = sum(t == "generate" for t in tasks.values())  # share the KV memory
    engines = {}
    for spec in specs:
        config = EngineConfig(model=spec.path, name=spec.name, task=tasks[spec.name],
                              **engine_options)
        logger.info("Loading %s from %s", spec.name, spec.path)
        if config.task == "embed":
            engines[spec.name] = EmbeddingEngine(config)
            continue
        config = size_kv(config, memory_fraction, generators, kv_memory_bytes)
        engines[spec.name] = AsyncEngine(config, sampling_defaults=defaults[spec.name])
    for engine in engines.values():  # generation first (EngineConfig.embedding_share)
        if isinstance(engine, EmbeddingEngine):
            engine.yield_to = [e for e in engines.values() if isinstance(e, AsyncEngine)]
    return Engines(engines)


def model_task(spec: ModelSpec, task: str = "auto") -> str:
    """What a model serves under --task: "embed" or "generate" ("auto": an encoder-only
    model embeds, a decoder generates; an encoder cannot generate)."""
    kind = model_kind(spec.path)
    if task == "auto":
        return "embed" if kind == "encoder" else "generate"
    if task == "generate" and kind == "encoder":
        raise ValueError(f"{spec.name} is an encoder-only model: it serves embeddings "
                         f"(--task embed or auto), not generation")
    return task
