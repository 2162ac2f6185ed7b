"""The device side that concerns the process, not one runner: where compiled executables
are kept, joining a multi-process run, and sizing the KV cache from device memory before a
runner is built."""

from __future__ import annotations

import logging
import math
import os

import jax
import numpy as np

from engine.config import EngineConfig
from models.default_model import user_cache_dir
from models.llama import param_specs
from models.loader import load_config, resolve_dtype
from models.sharding import sharded_config

logger = logging.getLogger(__name__)


def executable_store_dir() -> str | None:
    """Where compiled step executables are kept between runs (engine.executable_store):
    $XLASERVE_COMPILE_CACHE, else the user cache; None when that variable is "off", in a
    multi-process run (each process compiles afresh there, see init_distributed), or when
    XLA's own persistent cache was turned on by someone else (its executables do not survive
    a second serialization on CPU)."""
    setting = os.environ.get("XLASERVE_COMPILE_CACHE", "")
    if setting == "off" or _distributed or jax.config.jax_compilation_cache_dir:
        return None
    return setting or str(user_cache_dir() / "executables")


_distributed = False  # set by init_distributed


def init_distributed(coordinator_address: str, num_processes: int, process_id: int) -> int:
    """Join the multi-process JAX runtime (before any other jax call); returns the number
    of devices across all processes. CPU collectives go over gloo (GPUs and TPUs bring
    their own)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Without this a follower that dies takes process 0 down with it (the coordination
    # service terminates every task); with it process 0 lives to report the loss.
    try:
        jax.config.update("jax_enable_recoverability", True)
    except AttributeError:  # a jax without the flag: a dead follower then ends process 0
        logger.warning("this jax cannot survive a dead follower (no jax_enable_recoverability)")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    # Seen on CPU (jax 0.10.2): with the persistent compilation cache warm, process 0 with 2
    # devices and a follower with 1 hung in the first warmup step; with it off they did
    # not. Multi-process runs compile afresh.
    global _distributed
    _distributed = True
    logger.info("Process %d of %d: %d local and %d global devices", process_id, num_processes,
                jax.local_device_count(), jax.device_count())
    return jax.device_count()


# Without --num-pages or --gpu-memory-utilization, the KV cache holds every sequence at full
# length, but takes at most this fraction of device memory (host RAM on CPU, which the rest
# of the machine shares).
DEFAULT_MEMORY_FRACTION = {"cpu": 0.3}
DEFAULT_ACCELERATOR_FRACTION = 0.9


def device_memory_bytes() -> int:
    """Memory of one device: the accelerator's limit, or physical RAM on CPU."""
    stats = jax.local_devices()[0].memory_stats() or {}
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
    tp = config.tensor_parallel_size
    run_cfg = sharded_config(cfg, tp)  # fails here, at startup, if tp cannot split the model
    # Per device: a 1/tp share of the (nearly all split) weights and of every page's KV heads.
    weights = itemsize * sum(math.prod(s.shape) for s in param_specs(cfg).values()) / tp
    page = (2 * cfg.num_layers * config.block_size * run_cfg.num_kv_heads // tp
            * cfg.head_dim * itemsize)
    fraction = memory_fraction or DEFAULT_MEMORY_FRACTION.get(jax.default_backend(),
                                                              DEFAULT_ACCELERATOR_FRACTION)
    memory = device_memory_bytes()
    if jax.default_backend() == "cpu":
        memory /= tp  # (fake) CPU devices share one RAM
    budget = fraction * memory / num_models - weights
    fit = int(budget // page)
    if fit < 2:
        raise ValueError(f"{config.model}: {fraction:.0%} of device memory "
                         f"({memory / 2**30:.1f} GiB) leaves no room for KV pages "
                         f"after {weights / 2**30:.2f} GiB of weights")
    pages = fit if memory_fraction else min(fit, config.total_blocks)
    logger.info("KV cache for %s: %d pages of %d tokens (%.2f GiB)", config.model, pages,
                config.block_size, pages * page / 2**30)
    return pages
