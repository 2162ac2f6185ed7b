"""Device memory and the KV cache's size: what concerns the process rather than one
runner. `size_kv` settles a config's KV budget before a runner is built (a page count, or a
share of device memory the runner sizes once it knows its weights and largest step);
`kv_pages` turns a budget into pages; `resident_bytes` for the startup memory breakdown.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import jax
import numpy as np

from engine.config import EngineConfig
from engine.distributed import is_distributed
from models.loader import load_config, resolve_dtype
from models.registry import param_specs
from models.sharding import sharded_config
from ops.kv_cache import kv_token_bytes, resolve_kv_dtype

logger = logging.getLogger(__name__)


# Without --num-pages, --kv-cache-memory-bytes or --gpu-memory-utilization, the KV pool holds
# every sequence at full length, but takes at most: on CPU this share of RAM (which the rest of
# the machine shares; requests beyond it wait for pages or are preempted, as with llama.cpp's
# -c), on an accelerator this fraction of its memory after the weights.
DEFAULT_CPU_KV_SHARE = 1 / 32
DEFAULT_ACCELERATOR_FRACTION = 0.9


def resident_bytes() -> int | None:
    """This process's resident memory (Linux), or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def device_memory_bytes() -> int:
    """Memory of one device: the accelerator's limit, or physical RAM on CPU."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def size_kv(config: EngineConfig, memory_fraction: float | None = None, num_models: int = 1,
            kv_memory_bytes: int | None = None) -> EngineConfig:
    """`config` with its KV budget settled (what the server and the bench start from). A
    share of device memory is left to the runner, which sizes the pool once it knows what the
    weights and its largest step take (`kv_pages` with `weight_bytes` and `step_bytes`): an
    explicit `memory_fraction`, split between the models served, goes in
    `gpu_memory_utilization`; the accelerator default of one model needs nothing more. The
    page count is set here for a byte budget, the CPU default, and from estimates where the
    runner cannot size alone (an accelerator default shared by several models, and
    multi-process runs, where every process must build the same pool)."""
    if config.num_blocks is not None:
        return config
    if kv_memory_bytes is None and not is_distributed():
        if memory_fraction is not None:
            return dataclasses.replace(config,
                                       gpu_memory_utilization=memory_fraction / num_models)
        if jax.default_backend() != "cpu" and num_models == 1:
            return config
    return dataclasses.replace(config, num_blocks=kv_pages(config, memory_fraction, num_models,
                                                           kv_memory_bytes))


def sized_by_runner(config: EngineConfig) -> bool:
    """Whether the runner sizes `config`'s KV pool (see `size_kv`)."""
    return config.num_blocks is None and (config.gpu_memory_utilization is not None
                                          or jax.default_backend() != "cpu")


def kv_pages(config: EngineConfig, memory_fraction: float | None = None,
             num_models: int = 1, kv_memory_bytes: int | None = None, *,
             weight_bytes: float | None = None, step_bytes: int = 0,
             model_config=None) -> int:
    """KV pages (incl. the reserved page 0) for `config`. With `kv_memory_bytes`: what fits in
    that many bytes (per model). With a fraction (or `config.gpu_memory_utilization`): what
    fits in that share of device memory after the weights (`weight_bytes` per device, else
    estimated as float) and `step_bytes`, the temporary memory of the largest step
    (`model_config`: the model's shape when it is not read from `config.model`). Without
    either: enough for every sequence at full length, capped by the platform's default
    budget. Fewer pages than one `max_model_len` sequence needs is a startup error naming
    the budget."""
    if config.num_blocks is not None:
        return config.num_blocks
    memory_fraction = memory_fraction or config.gpu_memory_utilization
    cfg = model_config or load_config(config.model)  # the runner's own (random weights too)
    itemsize = np.dtype(resolve_dtype(config.dtype)).itemsize
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype))
    tp = config.tensor_parallel_size
    run_cfg = sharded_config(cfg, tp)  # fails here, at startup, if tp cannot split the model
    # Per device: a 1/tp share of the (nearly all split) weights and of every page's KV heads.
    weights = weight_bytes if weight_bytes is not None else (
        itemsize * sum(math.prod(s.shape) for s in param_specs(cfg).values()) / tp)
    page = (2 * cfg.num_layers * config.block_size * run_cfg.num_kv_heads // tp
            * kv_token_bytes(kv_dtype, cfg.head_dim))
    draft = _draft_config(config)
    if draft is not None:  # its own pool of as many pages, and its weights (as float)
        page += (2 * draft.num_layers * config.block_size * draft.num_kv_heads
                 * kv_token_bytes(kv_dtype, draft.head_dim))
        weights += itemsize * sum(math.prod(s.shape) for s in param_specs(draft).values())
    memory = device_memory_bytes()
    cpu = jax.default_backend() == "cpu"
    if cpu:
        memory /= tp  # (fake) CPU devices share one RAM
    if kv_memory_bytes is not None:
        budget = kv_memory_bytes / tp
        what = f"--kv-cache-memory-bytes ({kv_memory_bytes / 2**30:.2f} GiB)"
    elif memory_fraction is not None or not cpu:
        fraction = memory_fraction or DEFAULT_ACCELERATOR_FRACTION
        budget = fraction * memory / num_models - weights - step_bytes
        what = (f"{fraction:.0%} of device memory ({memory / 2**30:.1f} GiB) after "
                f"{weights / 2**30:.2f} GiB of weights and {step_bytes / 2**30:.2f} GiB for "
                f"the largest step")
    else:
        budget = DEFAULT_CPU_KV_SHARE * memory / num_models
        what = (f"the default KV budget, 1/{round(1 / DEFAULT_CPU_KV_SHARE)} of RAM "
                f"({budget / 2**30:.2f} GiB)")
    fit = max(int(budget // page), 0)
    explicit = kv_memory_bytes is not None or memory_fraction is not None
    pages = fit if explicit else min(fit, config.total_blocks)
    need = -(-config.max_model_len // config.block_size)
    if pages - 1 < need:
        raise ValueError(
            f"{config.model}: {what} holds {max(pages - 1, 0)} KV pages of "
            f"{config.block_size} tokens, fewer than one sequence of max_model_len "
            f"{config.max_model_len} needs ({need}): give the KV cache more memory "
            f"(--kv-cache-memory-bytes, --gpu-memory-utilization, --num-pages) or lower "
            f"--max-model-len")
    logger.info("KV cache for %s: %d pages of %d tokens (%d tokens, %.2f GiB in %s%s; budget: "
                "%s)", config.model, pages, config.block_size, pages * config.block_size,
                pages * page / 2**30, kv_dtype.name,
                ", the draft model's pages included" if draft is not None else "", what)
    return pages


def _draft_config(config: EngineConfig):
    """The model config of `config`'s draft model (speculative decoding), or None."""
    spec = config.speculative
    if spec is None or getattr(spec, "model", None) is None:
        return None
    from engine.draft_model import draft_path  # (it imports the runner, which imports this)

    return load_config(draft_path(spec.model))
