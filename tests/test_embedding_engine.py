"""The embedding engine's host side against a fake runner whose vectors are computable by
hand: batching into the bucket table, limits, abandoned requests, reboots."""

import asyncio
import threading

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


def test_the_bucket_table_stays_within_the_token_budget():
    buckets = embed_buckets(64, 2048, 512)
    assert (1, 512) in buckets and (64, 16) in buckets and (64, 32) in buckets
    assert all(rows * length <= 2048 for rows, length in buckets)
    assert [length for rows, length in buckets if rows == 1] == [16, 32, 64, 128, 256, 512]
    # a lone input longer than the budget still has its bucket
    assert embed_buckets(4, 64, 128)[-1] == (1, 128)
    assert bucket_for(buckets, 3, 20) == (4, 32)
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
    for tokens, lengths in runs:
        rows, length = tokens.shape
        assert rows * length <= 64 or rows == 1
        assert (tokens[lengths == 0] == 0).all()  # padding rows are zeros


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
