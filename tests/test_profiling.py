"""Traces read back (engine/profiling.py): busy time and own time from the events, and the
server's /start_profile and /stop_profile (only with XLASERVE_PROFILER_DIR)."""

from __future__ import annotations

import collections
import types

from fakes import make_engine
from starlette.testclient import TestClient

from engine.async_engine import Engines
from engine.profiling import _busy_ns, _self_times
from server.app import build_app


def test_busy_time_counts_overlapping_events_once():
    assert _busy_ns([(5, 10), (0, 10), (20, 5), (21, 1)]) == 20
    assert _busy_ns([]) == 0


def test_own_time_leaves_the_nested_events_out():
    event = lambda name, start, duration: types.SimpleNamespace(
        name=name, start_ns=start, duration_ns=duration)
    times, counts = collections.Counter(), collections.Counter()
    # a(0..10) holds b(2..5), which holds d(3..4), and c(6..8); e(12..13) stands alone
    _self_times([event("c", 6, 2), event("a", 0, 10), event("b", 2, 3), event("d", 3, 1),
                 event("e", 12, 1), event("a", 20, 4)], times, counts)
    assert times == {"a": 5 + 4, "b": 2, "c": 2, "d": 1, "e": 1}
    assert counts == {"a": 2, "b": 1, "c": 1, "d": 1, "e": 1}


def test_the_server_traces_between_start_and_stop(tokenizer, tmp_path):
    engine, _ = make_engine(tokenizer, name="fake")
    try:
        plain = TestClient(build_app(Engines({"fake": engine})))
        assert plain.post("/start_profile").status_code == 404  # not without the setting
        app = build_app(Engines({"fake": engine}), profiler_dir=str(tmp_path / "trace"))
        with TestClient(app) as client:
            r = client.post("/stop_profile")
            assert r.status_code == 409 and "no profile is running" in r.json()["error"]["message"]
            assert client.post("/start_profile").json()["status"] == "started"
            assert client.post("/start_profile").status_code == 409  # one at a time
            done = client.post("/v1/completions", json={"model": "fake", "prompt": "hi",
                                                         "max_tokens": 5, "ignore_eos": True})
            assert done.status_code == 200
            summary = client.post("/stop_profile").json()
            assert summary["status"] == "stopped" and summary["steps"] >= 5
            assert summary["trace"].startswith(str(tmp_path / "trace"))
            assert summary["wall_ms_per_step"] > 0 and summary["top_host"]
            assert client.post("/start_profile").status_code == 200  # again after a stop
            assert client.post("/stop_profile").status_code == 200
    finally:
        engine.shutdown()
