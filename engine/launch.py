"""Starting engines for serving: which model files, under which names, with how many KV pages.

The server's command line comes here (it never imports models/ or jax itself):
`parse_model_arg` reads `--model [name=]path`, `kv_pages` sizes the KV cache from
a memory fraction, and `start_engines` loads and warms up one AsyncEngine per model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path

import jax
import numpy as np

from engine.async_engine import AsyncEngine, Engines
from engine.config import EngineConfig
from models.default_model import SERVED_NAME, default_model_path, fetch_default_model
from models.llama import param_specs
from models.loader import load_config, resolve_dtype

logger = logging.getLogger(__name__)

# Without --num-pages or --gpu-memory-utilization, the KV cache holds every sequence at full
# length, but takes at most this fraction of device memory (host RAM on CPU, which the rest
# of the machine shares).
DEFAULT_MEMORY_FRACTION = {"cpu": 0.3}
DEFAULT_ACCELERATOR_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str


def parse_model_arg(value: str | None) -> ModelSpec:
    """`path`, `name=path`, or None for the default model (fetched if missing)."""
    if value is None:
        return ModelSpec(SERVED_NAME, str(fetch_default_model()))
    name, sep, path = value.partition("=")
    if not sep or "/" in name or Path(value).exists():
        name, path = "", value
    if not Path(path).exists():
        raise FileNotFoundError(f"--model {value}: {path} does not exist")
    if not name:
        p = Path(path)
        name = SERVED_NAME if p.resolve() == default_model_path().resolve() else (
            p.stem if p.is_file() else p.name)
    return ModelSpec(name, path)


def device_memory_bytes() -> int:
    """Memory of one device: the accelerator's limit, or physical RAM on CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_pages(config: EngineConfig, memory_fraction: float | None = None,
             num_models: int = 1) -> int:
    """KV pages (incl. the reserved page 0) for `config`. With a fraction: what fits in that
    share of device memory after the weights. Without: enough for every sequence at full
    length, capped by the default fraction."""
    if config.num_blocks is not None:
        return config.num_blocks
    cfg = load_config(config.model)
    itemsize = np.dtype(resolve_dtype(config.dtype)).itemsize
    weights = itemsize * sum(math.prod(s.shape) for s in param_specs(cfg).values())
    page = 2 * cfg.num_layers * config.block_size * cfg.num_kv_heads * cfg.head_dim * itemsize
    fraction = memory_fraction or DEFAULT_MEMORY_FRACTION.get(jax.default_backend(),
                                                              DEFAULT_ACCELERATOR_FRACTION)
    budget = fraction * device_memory_bytes() / num_models - weights
    fit = int(budget // page)
    if fit < 2:
        raise ValueError(f"{config.model}: {fraction:.0%} of device memory "
                         f"({device_memory_bytes() / 2**30:.1f} GiB) leaves no room for KV pages "
                         f"after {weights / 2**30:.2f} GiB of weights")
    pages = fit if memory_fraction else min(fit, config.total_blocks)
    logger.info("KV cache for %s: %d pages of %d tokens (%.2f GiB)", config.model, pages,
                config.block_size, pages * page / 2**30)
    return pages


def start_engines(specs: list[ModelSpec], memory_fraction: float | None = None,
                  **engine_options) -> Engines:
    """Load and warm up one engine per model (in order); returns them by served name."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"served model names must be unique, got {names}")
    engines = {}
    for spec in specs:
        config = EngineConfig(model=spec.path, name=spec.name, **engine_options)
        config = dataclasses.replace(config, num_blocks=kv_pages(config, memory_fraction,
                                                                 len(specs)))
        logger.info("Loading %s from %s", spec.name, spec.path)
        engines[spec.name] = AsyncEngine(config)
    return Engines(engines)
