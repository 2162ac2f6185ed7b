"""Joining a multi-process JAX run: `init_distributed`, before any other jax call, and
whether this process did (`is_distributed`: the executable store and KV sizing behave
differently there). Multi-host steps themselves travel over engine/cluster.py."""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)

_distributed = False  # set by init_distributed


def is_distributed() -> bool:
    """Whether this process joined a multi-process run (init_distributed)."""
    return _distributed


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
