"""The multi-host step channel (engine/cluster.py, engine/cluster_frames.py) over real
sockets on 127.0.0.1: a real Leader, and the real `cluster.follow` in a thread with a
recording stand-in for its ModelRunner (no model, no jax). The follower gets exactly what
the leader sent; a frame that is altered, replayed, skipped, recorded on another connection,
a pickle, or not of the typed format is refused and never run; off loopback nothing starts
without a shared secret, and on loopback without one the key is private to this run."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pickle
import stat
import struct
import sys
import threading
import time
import types
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path

import numpy as np
import pytest
from servers import free_port

from engine import cluster
from engine.batch import empty_batch
from engine.config import EngineConfig

SECRET = "a-test-secret-0123456789abcdef"
CONFIG = EngineConfig(model="/models/m.gguf", name="m", max_model_len=64, max_num_seqs=2,
                      max_num_batched_tokens=8, block_size=16, num_blocks=9,
                      gpu_memory_utilization=0.5, seed=7)


def a_step_batch():
    """A step's inputs with every field set: NaN and -inf among the floats, a reset with an
    empty output, a grammar's mask."""
    rng = np.random.default_rng(0)
    batch = empty_batch(CONFIG, (8, 2))
    batch.num_rows = 2
    batch.body[:] = rng.integers(-1, 1000, batch.body.size)
    batch.sampling_ints[:] = rng.integers(-2**31, 2**31 - 1, batch.sampling_ints.shape)
    batch.sampling_floats[:] = rng.standard_normal(batch.sampling_floats.shape)
    batch.sampling_floats[0, 0], batch.sampling_floats[1, 1] = np.nan, -np.inf
    batch.resets.append((1, np.array([5, 6, 7], np.int32), np.array([], np.int32)))
    mask = rng.integers(-2**31, 2**31 - 1, (2, 4), dtype=np.int32)
    batch.token_mask = functools.partial(np.asarray, mask)
    return batch


def assert_same_array(got, want):
    assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())


@pytest.fixture
def runners(monkeypatch):
    """What the follower's ModelRunners were built from and asked to run."""
    built, runs = [], []

    class RecordingRunner:
        def __init__(self, config):
            built.append(config)

        def run(self, batch, fuse=True):
            runs.append((batch, fuse))

    module = types.ModuleType("engine.model_runner")
    module.ModelRunner = RecordingRunner
    monkeypatch.setitem(sys.modules, "engine.model_runner", module)
    return built, runs


@dataclasses.dataclass
class Pair:
    leader: cluster.Leader
    follower: threading.Thread
    status: list  # the follower's exit status, once it has returned
    sent: list  # the bytes of each frame the leader wrote to the follower
    tamper: object = None  # bytes -> bytes | None (drop), applied to what the leader writes

    def send_raw(self, data: bytes) -> None:
        Connection.send_bytes(self.leader._conns[0], data)

    def follower_exit(self, timeout: float = 10) -> int | None:
        self.follower.join(timeout)
        return self.status[0] if self.status else None

    def lost(self, timeout: float = 10) -> str | None:
        deadline = time.monotonic() + timeout
        while self.leader.lost is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.leader.lost


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def start(monkeypatch, tmp_path, runners):
    """start(**follow_and_leader_kwargs) -> a connected leader and follower."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XLASERVE_CLUSTER_KEY", SECRET)
    pairs = []
    send_bytes = Connection.send_bytes

    def recording(conn, buf, *args):
        for pair in pairs:
            if pair.leader._conns and conn is pair.leader._conns[0]:
                buf = bytes(buf)
                pair.sent.append(buf)
                if pair.tamper is not None:
                    buf = pair.tamper(buf)
                    if buf is None:
                        return None
        return send_bytes(conn, buf, *args)

    monkeypatch.setattr(Connection, "send_bytes", recording)

    def start_pair(**kwargs) -> Pair:
        coordinator = f"127.0.0.1:{free_port(consecutive=2)}"
        status = []
        follower = threading.Thread(target=lambda: status.append(
            cluster.follow(coordinator, retry_for=30, **kwargs)), daemon=True)
        follower.start()
        pair = Pair(cluster.Leader(coordinator, num_followers=1, timeout=30, **kwargs),
                    follower, status, [])
        pairs.append(pair)
        return pair

    yield start_pair
    for pair in pairs:
        pair.tamper = None
        pair.leader.close()
        pair.follower.join(10)


@pytest.mark.parametrize("secret", ["env", "file", "per-run"])
def test_an_engine_config_and_a_step_batch_arrive_bit_identical(secret, start, runners,
                                                                 monkeypatch, tmp_path):
    kwargs = {}
    if secret == "file":
        monkeypatch.delenv("XLASERVE_CLUSTER_KEY")
        key_file = tmp_path / "cluster.key"
        key_file.write_text(SECRET + "\n")
        key_file.chmod(0o600)
        kwargs["key_file"] = str(key_file)
    elif secret == "per-run":
        monkeypatch.delenv("XLASERVE_CLUSTER_KEY")
    pair = start(**kwargs)
    built, runs = runners
    batch = a_step_batch()
    pair.leader.send("runner", CONFIG)
    pair.leader.send("run", (CONFIG.model, batch, True))
    wait_for(lambda: len(runs) == 1)
    assert built == [CONFIG]
    got, fused = runs[0]
    assert fused is True
    assert (got.bucket, got.num_rows) == (batch.bucket, batch.num_rows)
    for name in ("body", "sampling_ints", "sampling_floats"):
        assert_same_array(getattr(got, name), getattr(batch, name))
    assert len(got.resets) == len(batch.resets)
    for (slot, prompt, output), (want_slot, want_prompt, want_output) in zip(
            got.resets, batch.resets, strict=True):
        assert slot == want_slot
        assert_same_array(prompt, want_prompt)
        assert_same_array(output, want_output)
    assert_same_array(got.token_mask(), batch.token_mask())
    assert got.views.keys() == batch.views.keys()
    for name, view in batch.views.items():
        assert_same_array(got.views[name], view)
    pair.leader.close()
    assert pair.follower_exit() == 0  # the leader's close ends the follower cleanly


def test_a_frame_with_a_flipped_mac_byte_is_refused(start, runners):
    pair = start()
    pair.leader.send("runner", CONFIG)
    wait_for(lambda: len(runners[0]) == 1)
    pair.tamper = lambda frame: bytes([frame[0] ^ 1]) + frame[1:]  # the MAC's first byte
    # The send may already see the follower's refusal (its check after sending) or not.
    with contextlib.suppress(cluster.ClusterLost):
        pair.leader.send("run", (CONFIG.model, a_step_batch(), False))
    assert pair.follower_exit() == 1
    assert "bad MAC" in pair.lost()
    assert runners[1] == []


@pytest.mark.parametrize("how", ["replayed", "skipped"])
def test_a_replayed_or_skipped_frame_is_refused(how, start, runners):
    pair = start()
    built, runs = runners
    if how == "skipped":
        pair.tamper = lambda frame: None  # the "runner" frame never arrives
        pair.leader.send("runner", CONFIG)
        pair.tamper = None
        with contextlib.suppress(cluster.ClusterLost):  # the refusal may come back at once
            pair.leader.send("run", (CONFIG.model, a_step_batch(), False))
    else:
        pair.leader.send("runner", CONFIG)
        pair.leader.send("run", (CONFIG.model, a_step_batch(), False))
        wait_for(lambda: len(runs) == 1)
        pair.send_raw(pair.sent[-1])  # the same bytes again
    assert pair.follower_exit() == 1
    assert "a replayed or reordered frame" in pair.lost()
    assert len(runs) == (1 if how == "replayed" else 0)
    assert len(built) == (1 if how == "replayed" else 0)


def test_a_frame_recorded_on_another_connection_is_refused(start, runners):
    first = start()
    first.leader.send("runner", CONFIG)
    wait_for(lambda: len(runners[0]) == 1)
    second = start()  # same secret, a new connection
    second.send_raw(first.sent[0])  # its sequence number (0) is the one expected
    assert second.follower_exit() == 1
    assert "bad MAC" in second.lost()
    assert len(runners[0]) == 1


class WriteFile:
    """A pickle that writes a file when it is loaded."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.write_text, (self.path, "pwned")


@pytest.mark.parametrize("authenticated", [False, True])
def test_a_pickle_is_refused_and_never_loaded(authenticated, start, runners, tmp_path):
    """Raw, as a frame from someone without the secret; and inside a correctly MACed and
    numbered frame, as from a leader that had been made to send one: neither is loaded."""
    target = tmp_path / "pwned"
    payload = pickle.dumps(("run", WriteFile(target)), protocol=pickle.HIGHEST_PROTOCOL)
    pair = start()
    if authenticated:
        pair.leader._channels[0].send_payload(payload)
    else:
        pair.send_raw(payload)
    assert pair.follower_exit() == 1
    assert not target.exists()
    assert "refused" in pair.lost()
    assert runners == ([], [])


def header_payload(header: dict, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack(">I", len(text)) + text + data


CONFIG_FIELDS = dataclasses.asdict(CONFIG)


@pytest.mark.parametrize("payload, why", [
    (header_payload({"kind": "exec", "arrays": [], "body": {"code": "print(1)"}}),
     "unknown message kind 'exec'"),
    (header_payload({"kind": "runner", "arrays": [],
                     "body": {**CONFIG_FIELDS, "model": {"$pickle": "gASV..."}}}),
     "unknown type tag"),
    (header_payload({"kind": "run", "arrays": [["|O", [1]]], "body": {}}, b"\0" * 8),
     "not an array of an allowed dtype"),
    (header_payload({"kind": "runner", "arrays": [], "body": {**CONFIG_FIELDS, "extra": 1}}),
     "differ from this EngineConfig's"),
    (header_payload({"kind": "runner", "arrays": [], "body": {**CONFIG_FIELDS,
                                                              "block_size": 3}}),
     "block_size must be a power of two"),  # EngineConfig.__post_init__ ran
], ids=["unknown-kind", "unknown-tag", "object-dtype", "extra-field", "invalid-config"])
def test_an_authenticated_frame_outside_the_typed_format_is_refused(payload, why, start,
                                                                    runners):
    pair = start()
    pair.leader._channels[0].send_payload(payload)
    assert pair.follower_exit() == 1
    assert why in pair.lost()
    assert runners == ([], [])


@pytest.mark.parametrize("host", ["10.1.2.3", "0.0.0.0"])
def test_a_coordinator_off_loopback_needs_a_secret(host, monkeypatch, runners, caplog):
    monkeypatch.delenv("XLASERVE_CLUSTER_KEY", raising=False)
    with pytest.raises(ValueError, match="needs a shared secret.*--cluster-key-file PATH"):
        cluster.Leader(f"{host}:8476", num_followers=1, timeout=5)
    assert cluster.follow(f"{host}:8476", retry_for=5) == 2
    assert "--cluster-key-file PATH (or XLASERVE_CLUSTER_KEY)" in caplog.text
    assert cluster.channel_key("localhost:8476") is None  # loopback: a per-run key


def test_without_a_secret_on_loopback_the_key_is_private_to_the_run(monkeypatch, tmp_path,
                                                                     runners):
    monkeypatch.delenv("XLASERVE_CLUSTER_KEY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    port = free_port(consecutive=2)
    coordinator = f"127.0.0.1:{port}"
    leaders = []
    leading = threading.Thread(target=lambda: leaders.append(
        cluster.Leader(coordinator, num_followers=1, timeout=30)), daemon=True)
    leading.start()
    # The old public default key no longer opens the channel.
    deadline = time.monotonic() + 10
    while True:
        try:
            Client(("127.0.0.1", port + 1), authkey=b"xlaserve-step-channel").close()
            pytest.fail("the public default key was accepted")
        except AuthenticationError:
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    key_file = Path(*cluster.run_key_path(port + 1))
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    assert len(key_file.read_bytes()) == 64  # 32 random bytes, hex
    status = []
    follower = threading.Thread(target=lambda: status.append(
        cluster.follow(coordinator, retry_for=30)), daemon=True)
    follower.start()
    leading.join(30)
    assert not key_file.exists()  # on disk only until every follower has connected
    leaders[0].send("runner", CONFIG)
    wait_for(lambda: runners[0] == [CONFIG])
    leaders[0].close()
    follower.join(10)
    assert status == [0]


def test_a_follower_with_another_secret_fails_fast(monkeypatch, tmp_path, runners, caplog):
    monkeypatch.setenv("XLASERVE_CLUSTER_KEY", SECRET)
    other = tmp_path / "other.key"
    other.write_text("another-secret-0123456789abcdef")
    os.chmod(other, 0o600)
    coordinator = f"127.0.0.1:{free_port(consecutive=2)}"
    errors = []

    def lead():
        try:
            cluster.Leader(coordinator, num_followers=1, timeout=5)
        except RuntimeError as e:
            errors.append(e)

    leading = threading.Thread(target=lead, daemon=True)
    leading.start()
    assert cluster.follow(coordinator, retry_for=10, key_file=str(other)) == 1
    assert "refused this process's shared secret" in caplog.text
    leading.join(10)
    assert "only 0 of 1 followers connected" in str(errors[0])
    assert runners == ([], [])
