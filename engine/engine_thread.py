"""EngineThread: the engine thread and its recovery, shared by a generating model's
AsyncEngine (engine/async_engine.py) and a pooling model's EmbeddingEngine
(engine/embedding_engine.py).

The device side (an LLMEngine, an EmbeddingRunner) is built and warmed from the config by
the factory, then served on a thread of its own, fed through a thread-safe inbox. When
serving raises, the engine is dead: what waits on it fails with EngineDeadError, the dead
one's device memory goes (its host bookkeeping stays readable), and it is built again from
the same config, retried every second until it builds. In a multi-host cluster that has lost
a process there is no rebuilding; the engine stays down.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from engine import cluster
from engine.config import EngineConfig

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine failed while serving this request, or is rebooting."""


class EngineThread:
    """Build the device side, serve it on a thread, rebuild it when it dies. A subclass
    serves (`_serve`, until `_stopping`) and fails what waits (`_fail_waiting`)."""

    task: str  # the routes' kind: "generate" or "embed"
    WAKE = ("wake",)  # put in the inbox to wake a thread blocked on it

    def __init__(self, config: EngineConfig, factory: Callable):
        self.config = config
        self.name = config.name or config.model
        self._factory = factory
        self._core = self._build()  # the device side, rebuilt after a death
        self.num_restarts = 0
        self.alive = True
        self._inbox: queue.Queue = queue.Queue()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}",
                                        daemon=True)

    def _start(self) -> None:
        """Start the engine thread (a subclass's last step of __init__)."""
        self._thread.start()

    def _build(self):
        core = self._factory(self.config)
        core.warmup()
        return core

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(self.WAKE)
        self._thread.join(timeout=30)

    # ---- engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._serve()
            except Exception as e:  # the engine died: fail what waits, rebuild it
                self._reboot(e)
                if cluster.lost() is not None:  # no rebuilding without the other processes
                    return

    def _serve(self) -> None:
        raise NotImplementedError

    def _fail_waiting(self, error: EngineDeadError) -> None:
        """Fail every request in flight or queued (the inbox included): nothing waits on a
        dead engine."""
        raise NotImplementedError

    def _retire(self, dead) -> None:
        """Keep what should outlive the dead device side (counters) before it is released."""

    def _reboot(self, error: Exception) -> None:
        self.alive = False
        logger.error("Engine %s is dead, rebooting", self.name, exc_info=error)
        self._fail_waiting(EngineDeadError(
            f"engine {self.name} failed: {type(error).__name__}: {error}"))
        dead = self._core
        self._retire(dead)
        # Its device memory goes before the next one is built: both at once would not fit at
        # a high --gpu-memory-utilization.
        dead.release()
        while not self._stopping and cluster.lost() is None:
            try:
                self._core = self._build()
                break
            except Exception:
                logger.exception("Rebuilding engine %s failed; retrying in 1s", self.name)
                time.sleep(1.0)
        if cluster.lost() is not None:
            logger.error("Engine %s stays down: %s", self.name, cluster.lost())
            return
        self.num_restarts += 1
        self.alive = True
        logger.info("Successfully rebooted engine %s", self.name)
