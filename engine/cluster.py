"""Multi-host serving: process 0 leads, the other processes follow step by step.

Every process has called `jax.distributed.initialize` (device.init_distributed), so
one mesh spans all their devices and every compiled step is an SPMD program that all of
them must run together. Process 0 runs the scheduler and the HTTP server; before each
thing it runs on the devices it sends the same command to the followers over this step
channel (`multiprocessing.connection` on the coordinator's host, port + 1, HMAC-
authenticated with XLASERVE_CLUSTER_KEY):

  ("runner", EngineConfig)  build a ModelRunner for this config (weights, KV pages)
  ("run", (model, StepBatch, fused))  run this padded batch through that model's compiled
                               step (fused: as one executable, ModelRunner.submit)

A follower that dies closes its connection: the leader's watcher marks the cluster lost,
and every runner of the leader then refuses to step (`ClusterLost`), so in-flight requests
fail with that error and /health reports 503 instead of waiting on a collective that can
never finish. A lost cluster is not rebuilt: restart all processes.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

logger = logging.getLogger(__name__)

DEFAULT_KEY = b"xlaserve-step-channel"


class ClusterLost(RuntimeError):
    """A follower process is gone: the mesh cannot run another step."""


def channel_address(coordinator_address: str) -> tuple[str, int]:
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator-address must be HOST:PORT, got {coordinator_address!r}")
    return host, int(port) + 1


def _key() -> bytes:
    return os.environ.get("XLASERVE_CLUSTER_KEY", "").encode() or DEFAULT_KEY


class Leader:
    """Process 0's end: one connection per follower, and a watcher thread on each."""

    def __init__(self, coordinator_address: str, num_followers: int, timeout: float = 300.0):
        host, port = channel_address(coordinator_address)
        self.lost: str | None = None
        self._on_lost: list = []
        self._lock = threading.Lock()
        self._conns: list[Connection] = []
        if not os.environ.get("XLASERVE_CLUSTER_KEY"):
            logger.warning("XLASERVE_CLUSTER_KEY is not set: the step channel uses the public "
                           "default key; set a shared secret outside a private network")
        listener = Listener((host, port), authkey=_key())  # process 0's own address
        logger.info("Waiting for %d follower(s) on port %d", num_followers, port)
        accept = threading.Thread(
            target=lambda: self._conns.extend(listener.accept() for _ in range(num_followers)),
            daemon=True)
        accept.start()
        accept.join(timeout)  # a follower that never comes is an error, not a hang
        listener.close()
        if len(self._conns) < num_followers:
            raise RuntimeError(f"only {len(self._conns)} of {num_followers} followers "
                               f"connected to port {port} within {timeout:.0f}s")
        for i, conn in enumerate(self._conns, 1):
            threading.Thread(target=self._watch, args=(i, conn), daemon=True,
                             name=f"follower-watch-{i}").start()

    def _watch(self, index: int, conn: Connection) -> None:
        """Followers send nothing but a last word (plain text, never unpickled here); EOF or
        a message means it is gone."""
        try:
            message = conn.recv_bytes(4096).decode(errors="replace")
            reason = f"follower {index} failed: {message}"
        except (EOFError, OSError):
            reason = f"follower {index} disconnected"
        self._mark_lost(reason)

    def on_lost(self, callback) -> None:
        """Call `callback(reason)` (from a watcher thread) when the cluster is lost: an
        engine thread blocked in a collective with a dead peer may never return, so the
        engine fails its requests from here."""
        self._on_lost.append(callback)

    def _mark_lost(self, reason: str) -> None:
        if self.lost is not None:
            return
        self.lost = reason
        logger.error("Cluster lost: %s", reason)
        for callback in self._on_lost:
            callback(reason)

    def check(self) -> None:
        if self.lost is not None:
            raise ClusterLost(f"multi-host cluster lost ({self.lost}); restart all processes")

    def send(self, *message) -> None:
        """The same command to every follower, before the leader runs it itself (pickled
        once, however many followers: this is on every step's path)."""
        self.check()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            for i, conn in enumerate(self._conns, 1):
                try:
                    conn.send_bytes(payload)  # what conn.recv() on the follower unpickles
                except OSError as e:
                    self._mark_lost(f"follower {i} unreachable: {e}")
        self.check()

    def close(self) -> None:
        for conn in self._conns:
            conn.close()


# The leader of this process, when it is process 0 of several (set by the server CLI).
leader: Leader | None = None


def lost() -> str | None:
    """Why this process's cluster can no longer step, or None."""
    return None if leader is None else leader.lost


def follow(coordinator_address: str, retry_for: float = 300.0) -> int:
    """A follower's whole life: connect to the leader, then build runners and run steps as
    told until the leader closes the channel. Returns a process exit status."""
    from engine.model_runner import ModelRunner  # the device side

    address = channel_address(coordinator_address)
    deadline = time.monotonic() + retry_for
    while True:
        try:
            conn = Client(address, authkey=_key())
            break
        except OSError:
            if time.monotonic() > deadline:
                logger.error("No leader at %s:%d", *address)
                return 1
            time.sleep(0.5)
    logger.info("Following the leader at %s:%d", *address)
    runners: dict[str, ModelRunner] = {}
    try:
        while True:
            try:
                kind, payload = conn.recv()
            except EOFError:
                logger.info("The leader closed the step channel; exiting")
                return 0
            if kind == "runner":
                runners[payload.model] = ModelRunner(payload)
            elif kind == "run":
                model, batch, fused = payload  # the leader's choice of executables
                runners[model].run(batch, fuse=fused)
            else:
                raise ValueError(f"unknown step channel command {kind!r}")
    except Exception as e:
        logger.exception("Follower failed")
        try:
            conn.send_bytes(f"{type(e).__name__}: {e}".encode()[:4096])
        except OSError:
            pass
        return 1
