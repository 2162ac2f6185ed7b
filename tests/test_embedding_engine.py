"""The embedding engine's host side against a fake runner whose vectors are computable by
hand: batching into the bucket table, limits, abandoned requests, reboots."""

import asyncio
import threading
import types

import numpy as np
import pytest
from fakes import FakeEmbeddingRunner

from engine.async_engine import EngineDeadError, EngineOverloaded
from engine.config import EngineConfig
from engine.embedding_engine import EmbeddingEngine, bucket_for, embed_buckets
from engine.scheduler import RequestRejected


def expected(ids):
    return [sum(ids), len(ids), ids[0]]


def built(runners: list, **options):
    """A runner factory that keeps what it built in `runners`."""
    return lambda cfg: runners.append(FakeEmbeddingRunner(cfg, **options)) or runners[-1]


def engine_with(runner_factory, **options):
    config = EngineConfig(model="fake", max_num_seqs=8, max_num_batched_tokens=64, **options)
    return EmbeddingEngine(config, factory=runner_factory)


def test_the_bucket_table_pads_a_batch_by_an_eighth_at_most():
    buckets = embed_buckets(64, 512, 256)
    sizes = [t for t, _ in buckets]
    assert sizes[:9] == [16, 32, 48, 64, 80, 96, 112, 128, 144] and sizes[-1] == 512
    assert all(b - a <= max(16, a // 8) for a, b in zip(sizes, sizes[1:], strict=False))
    assert all(rows == min(t, 64) for t, rows in buckets)
    # an input longer than the budget still has its bucket
    assert embed_buckets(4, 64, 128)[-1] == (128, 4)
    assert bucket_for(buckets, 3, 130) == (144, 64)
    assert bucket_for(buckets, 1, 513) is None


def test_requests_get_their_own_vectors_in_order_whatever_they_were_batched_with():
    runners = []
    engine = engine_with(built(runners))
    rng = np.random.default_rng(0)
    requests = [[list(rng.integers(1, 1000, rng.integers(1, 60)))
                 for _ in range(rng.integers(1, 5))] for _ in range(30)]

    async def main():
        return await asyncio.gather(*(engine.embed(r) for r in requests))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for request, vectors in zip(requests, results, strict=True):
        assert vectors.tolist() == [expected(ids) for ids in request]
    runs = runners[0].runs
    assert sum(int((lengths > 0).sum()) for _, lengths in runs) == sum(map(len, requests))
    assert len(runs) < sum(map(len, requests))  # rows shared steps
    for tokens, lengths in runs:  # within the budget (or one row alone), padded by 1/8 at most
        assert lengths.sum() <= 64 or (lengths > 0).sum() == 1
        assert len(tokens) <= max(16, lengths.sum() * 9 // 8 + 16)


def test_bad_inputs_are_refused_before_anything_runs():
    runners = []
    engine = engine_with(built(runners))
    try:
        for inputs, words in (([[1] * 65], "maximum context length of 64"),
                              ([[]], "no tokens"), ([[5, 1000]], "outside the vocabulary")):
            with pytest.raises(RequestRejected, match=words):
                asyncio.run(engine.embed(inputs))
        assert runners[0].runs == []
    finally:
        engine.shutdown()


def test_a_full_queue_refuses_and_an_abandoned_request_never_runs():
    gate = threading.Event()
    runners = []
    engine = engine_with(built(runners, gate=gate),
                         max_waiting_requests=2)

    async def main():
        first = asyncio.ensure_future(engine.embed([[7] * 40]))
        while not runners[0].runs and engine.stats().num_running == 0:
            await asyncio.sleep(0.01)  # the first is in the runner, waiting on the gate
        second = asyncio.ensure_future(engine.embed([[9] * 40]))
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloaded):
            await engine.embed([[3]])
        second.cancel()  # its client left
        await asyncio.sleep(0.1)
        gate.set()
        third = await engine.embed([[4, 4]])
        return await first, third

    try:
        first, third = asyncio.run(main())
    finally:
        gate.set()
        engine.shutdown()
    assert first.tolist() == [expected([7] * 40)] and third.tolist() == [expected([4, 4])]
    assert not any((tokens == 9).any() for tokens, _ in runners[0].runs)


def test_a_failed_runner_fails_its_requests_and_is_rebuilt():
    runners = []
    engine = engine_with(built(runners, fail_on=13))
    try:
        with pytest.raises(EngineDeadError, match="device fell over"):
            asyncio.run(engine.embed([[13, 1], [2, 2]]))
        for _ in range(1000):  # the rebuild runs on the engine thread
            if engine.stats().alive:
                break
            threading.Event().wait(0.01)
        assert asyncio.run(engine.embed([[5, 6]])).tolist() == [expected([5, 6])]
        assert len(runners) == 2 and engine.stats().num_restarts == 1
        assert engine.stats().alive
    finally:
        engine.shutdown()


def test_beside_a_busy_generator_it_runs_one_input_a_step_and_gives_it_the_time(monkeypatch):
    import engine.embedding_engine as module

    class Clock:  # the engine's time: a step takes 10 ms, a wait takes what it asks
        now = 0.0

        def perf_counter(self):
            return self.now

        def sleep(self, seconds):
            self.now += seconds

    clock = Clock()
    monkeypatch.setattr(module, "time", clock)

    class SlowRunner(FakeEmbeddingRunner):
        def run(self, tokens, lengths):
            clock.now += 0.010
            return super().run(tokens, lengths)

    generator = types.SimpleNamespace(busy=True)
    runners = []
    engine = engine_with(lambda cfg: runners.append(SlowRunner(cfg)) or runners[-1],
                         embedding_share=0.2)
    engine.yield_to = [generator]
    inputs = [[i + 1] * 5 for i in range(6)]
    try:
        assert asyncio.run(engine.embed(inputs)).tolist() == [expected(x) for x in inputs]
        assert [int((lengths > 0).sum()) for _, lengths in runners[0].runs] == [1] * 6
        # 10 ms of steps in each 50: a wait of 40 ms after each step before the last's answer
        assert clock.now >= 6 * 0.010 + 5 * 0.040 - 1e-9
        generator.busy = False  # idle: as many rows a step as fit
        runs = len(runners[0].runs)
        asyncio.run(engine.embed(inputs))
        assert [int((lengths > 0).sum()) for _, lengths in runners[0].runs[runs:]] == [6]
    finally:
        engine.shutdown()
