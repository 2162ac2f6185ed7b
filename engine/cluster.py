"""Multi-host serving: process 0 leads, the other processes follow step by step.

Every process has called `jax.distributed.initialize` (distributed.init_distributed), so
one mesh spans all their devices and every compiled step is an SPMD program that all of
them must run together. Process 0 runs the scheduler and the HTTP server; before each
thing it runs on the devices it sends the same command to the followers over this step
channel (`multiprocessing.connection` on the coordinator's host, port + 1):

  ("runner", EngineConfig)  build a ModelRunner for this config (weights, KV pages)
  ("run", (model, StepBatch, fused))  run this padded batch through that model's compiled
                               step (fused: as one executable, ModelRunner.submit)

The channel runs nothing it receives: frames are typed (a JSON header and raw numpy
buffers, never pickle), each carries an HMAC-SHA256 under a shared secret over its
direction, its connection's nonces, its sequence number and its payload, and a follower
that receives a frame with a bad MAC, a replayed or reordered sequence number, or a
payload that does not decode leaves the cluster (engine/cluster_frames.py).

The secret is the contents of --cluster-key-file, else $XLASERVE_CLUSTER_KEY, the same on
every process. A coordinator that is not a loopback address needs one: without it leader
and followers refuse to start. On loopback without one, the leader writes a random per-run
key into the user's cache (a 0700 directory, a 0600 file) and the followers, being the same
user on the same machine, read it from there; it is deleted once they have all connected.

A follower that dies closes its connection: the leader's watcher marks the cluster lost,
and every runner of the leader then refuses to step (`ClusterLost`), so in-flight requests
fail with that error and /health reports 503 instead of waiting on a collective that can
never finish. A lost cluster is not rebuilt: restart all processes.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener
from pathlib import Path

from engine import cluster_frames as frames
from ops import cache_trust

logger = logging.getLogger(__name__)

KEY_ENV = "XLASERVE_CLUSTER_KEY"


class ClusterLost(RuntimeError):
    """A follower process is gone: the mesh cannot run another step."""


def channel_address(coordinator_address: str) -> tuple[str, int]:
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator-address must be HOST:PORT, got {coordinator_address!r}")
    return host, int(port) + 1


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is this machine's loopback (one that does not
    resolve is not)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


def channel_key(coordinator_address: str, key_file: str | None = None) -> bytes | None:
    """The shared secret: `key_file`'s contents (surrounding whitespace stripped), else
    $XLASERVE_CLUSTER_KEY. None where neither is given on a loopback coordinator (the leader
    then makes a per-run key); ValueError where neither is given off loopback."""
    host, _ = channel_address(coordinator_address)
    if key_file:
        key = Path(key_file).read_bytes().strip()
        if not key:
            raise ValueError(f"--cluster-key-file {key_file} is empty")
        if Path(key_file).stat().st_mode & 0o077:
            logger.warning("--cluster-key-file %s can be read by other users (chmod 600 it)",
                           key_file)
    else:
        key = os.environ.get(KEY_ENV, "").strip().encode()
    if key:
        if len(key) < 16:
            logger.warning("The step channel's shared secret has only %d bytes: use 32 random "
                           "ones", len(key))
        return key
    if is_loopback(host):
        return None
    raise ValueError(
        f"the step channel to {host} leaves this machine, so it needs a shared secret: put "
        f"the same random secret on every process with --cluster-key-file PATH (or {KEY_ENV}"
        f"), e.g. python -c 'import secrets; print(secrets.token_hex(32))' > cluster.key")


def run_key_path(port: int) -> tuple[Path, str]:
    """(root, path under it) of a loopback cluster's per-run key: the user's cache."""
    return cache_trust.user_cache_dir(), f"cluster/step-channel-{port}.key"


def _write_run_key(port: int) -> tuple[Path, bytes]:
    root, relative = run_key_path(port)
    directory = cache_trust.private_dir(root, "cluster")  # 0700, this user's alone
    path = Path(root, relative)
    tmp = directory / f".{path.name}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    key = secrets.token_hex(32).encode()
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    os.replace(tmp, path)  # a follower reads a whole key or none
    return path, key


def _read_run_key(port: int) -> bytes:
    with cache_trust.open_private(*run_key_path(port)) as f:  # this user's file, no link
        return f.read()


def _describe(key_file: str | None, key: bytes | None, port: int) -> str:
    if key_file:
        return f"--cluster-key-file {key_file}"
    if key is not None:
        return KEY_ENV
    root, relative = run_key_path(port)
    return (f"a per-run key in {Path(root, relative)} (loopback only: no shared secret "
            f"given)")


class Leader:
    """Process 0's end: one channel per follower, and a watcher thread on each."""

    def __init__(self, coordinator_address: str, num_followers: int, timeout: float = 300.0,
                 key_file: str | None = None):
        host, port = channel_address(coordinator_address)
        key = channel_key(coordinator_address, key_file)  # refuses off loopback without one
        self.lost: str | None = None
        self._closed = False
        self._on_lost: list = []
        self._lock = threading.Lock()
        self._conns: list = []  # the followers' connections, and their channels:
        self._channels: list[frames.Channel] = []
        run_key = None  # a per-run key's file: on disk until the followers have connected
        logger.info("Step channel authenticated with %s", _describe(key_file, key, port))
        if key is None:
            run_key, key = _write_run_key(port)
        listener = Listener((host, port), authkey=key)  # process 0's own address
        closing = threading.Event()

        def accept():
            while len(self._channels) < num_followers and not closing.is_set():
                try:
                    conn = listener.accept()  # the handshake: both ends prove the secret
                    channel = frames.open_leader_end(conn, key)
                except (AuthenticationError, frames.FrameRefused, OSError, EOFError) as e:
                    if not closing.is_set():
                        logger.warning("Refused a connection to the step channel: %s", e)
                        time.sleep(0.1)  # not a busy loop if the listener itself fails
                    continue
                self._conns.append(conn)
                self._channels.append(channel)

        logger.info("Waiting for %d follower(s) on port %d", num_followers, port)
        accepting = threading.Thread(target=accept, daemon=True)
        accepting.start()
        accepting.join(timeout)  # a follower that never comes is an error, not a hang
        closing.set()
        listener.close()
        if run_key is not None:  # every follower has read it, or none is coming
            run_key.unlink(missing_ok=True)
        if len(self._channels) < num_followers:
            self.close()
            raise RuntimeError(f"only {len(self._channels)} of {num_followers} followers "
                               f"connected to port {port} within {timeout:.0f}s")
        for i, channel in enumerate(self._channels, 1):
            threading.Thread(target=self._watch, args=(i, channel), daemon=True,
                             name=f"follower-watch-{i}").start()

    def _watch(self, index: int, channel: frames.Channel) -> None:
        """Followers send nothing but a last word: it, EOF or a refused frame means the
        follower is gone."""
        try:
            _, message = channel.recv()
            reason = f"follower {index} failed: {message}"
        except frames.FrameRefused as e:
            reason = f"follower {index} sent a refused frame ({e})"
        except (EOFError, OSError):
            reason = f"follower {index} disconnected"
        if not self._closed:
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

    def send(self, kind: str, value) -> None:
        """The same command to every follower, before the leader runs it itself (encoded
        once, however many followers: this is on every step's path)."""
        self.check()
        payload = frames.encode_message(kind, value)
        with self._lock:
            for i, channel in enumerate(self._channels, 1):
                try:
                    channel.send_payload(payload)  # numbered and MACed per follower
                except OSError as e:
                    self._mark_lost(f"follower {i} unreachable: {e}")
        self.check()

    def close(self) -> None:
        """Close every follower's channel (they exit), without marking the cluster lost."""
        self._closed = True
        for conn in self._conns:
            try:  # a shutdown sends EOF now: close alone waits for the watcher's blocked read
                with socket.socket(fileno=os.dup(conn.fileno())) as s:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


# The leader of this process, when it is process 0 of several (set by the server CLI).
leader: Leader | None = None


def lost() -> str | None:
    """Why this process's cluster can no longer step, or None."""
    return None if leader is None else leader.lost


def connect(coordinator_address: str, retry_for: float = 300.0,
            key_file: str | None = None) -> frames.Channel:
    """A follower's end of the channel, once the leader listens. Raises ValueError (no
    secret off loopback), AuthenticationError (another secret), TimeoutError (no leader)."""
    host, port = address = channel_address(coordinator_address)
    key = channel_key(coordinator_address, key_file)
    logger.info("Step channel authenticated with %s", _describe(key_file, key, port))
    deadline = time.monotonic() + retry_for
    while True:
        try:
            # A per-run key is read at every try: one left by an earlier run is refused
            # until the leader has written its own (which it does before listening).
            attempt = key or _read_run_key(port)
            conn = Client(address, authkey=attempt)
        except AuthenticationError:
            if key is not None:
                raise AuthenticationError(
                    f"the leader at {host}:{port} refused this process's shared secret (is it "
                    f"the same on every process?)") from None
        except (OSError, EOFError):  # not listening yet (FileNotFoundError: no key yet)
            pass
        else:
            try:
                return frames.open_follower_end(conn, attempt)
            except BaseException:
                conn.close()
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"no leader at {host}:{port} within {retry_for:.0f}s")
        time.sleep(0.5)


def follow(coordinator_address: str, retry_for: float = 300.0,
           key_file: str | None = None) -> int:
    """A follower's whole life: connect to the leader, then build runners and run steps as
    told until the leader closes the channel. Returns a process exit status."""
    try:
        channel_key(coordinator_address, key_file)  # refuse to start before anything else
    except (ValueError, OSError) as e:
        logger.error("cannot start: %s", e)
        return 2
    from engine.model_runner import ModelRunner  # the device side

    try:
        channel = connect(coordinator_address, retry_for, key_file)
    except (ValueError, OSError, EOFError, AuthenticationError) as e:
        logger.error("Cannot follow: %s", e)
        return 1
    logger.info("Following the leader at %s:%d", *channel_address(coordinator_address))
    runners: dict[str, ModelRunner] = {}
    try:
        while True:
            try:
                kind, payload = channel.recv()  # only "runner" or "run" get through
            except EOFError:
                logger.info("The leader closed the step channel; exiting")
                return 0
            if kind == "runner":
                runners[payload.model] = ModelRunner(payload)
            else:
                model, batch, fused = payload  # the leader's choice of executables
                runners[model].run(batch, fuse=fused)
    except frames.FrameRefused as e:
        logger.error("Refused a frame on the step channel (%s); leaving the cluster", e)
        return _last_word(channel, f"refused a frame: {e}")
    except Exception as e:
        logger.exception("Follower failed")
        return _last_word(channel, f"{type(e).__name__}: {e}")
    finally:
        channel.close()


def _last_word(channel: frames.Channel, message: str) -> int:
    try:
        channel.send("failed", message)
    except OSError:
        pass
    return 1
