"""The engine thread and its asyncio front end, driven by a fake runner whose next token is
always the previous token + 1 (outputs computable by hand, no compilation)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from fakes import make_engine, wait_until

from engine.async_engine import (
    EngineDeadError,
    EngineOverloaded,
    Engines,
    UnknownModel,
)
from engine.outputs import accumulate
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestRejected


async def collect(engine, prompt, params):
    outs = []
    async for out in engine.generate(prompt, params):
        outs.append(out)
    return outs


def whole(outs):
    """The request's whole output: its deltas folded."""
    total = None
    for out in outs:
        total = accumulate(total, out)
    return total




def all_free(engine):
    bm = engine.engine.block_manager
    return bm.num_free_blocks == bm.num_usable_blocks


P = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_streams_tokens_and_finishes(tokenizer):
    engine, _ = make_engine(tokenizer)
    try:
        outs = asyncio.run(collect(engine, [1000, 2000], P))
        assert [o.outputs[0].token_ids for o in outs] == [[2001], [2002], [2003], [2004],
                                                           [2005]]  # deltas
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert all_free(engine)
    finally:
        engine.shutdown()


def test_many_concurrent_requests(tokenizer):
    engine, _ = make_engine(tokenizer)

    async def main():
        prompts = [[100 * i + 7] * (1 + i % 5) for i in range(1, 25)]
        results = await asyncio.gather(*(collect(engine, p, P) for p in prompts))
        for p, outs in zip(prompts, results, strict=True):
            assert whole(outs).outputs[0].token_ids == [p[-1] + k for k in range(1, 6)]

    try:
        asyncio.run(main())
        assert wait_until(lambda: all_free(engine))
    finally:
        engine.shutdown()


def test_leaving_the_stream_aborts_and_frees_blocks(tokenizer):
    engine, runners = make_engine(tokenizer)
    seen = {}

    # The engine stalls in its 6th step, so the request cannot finish (its 20-token prompt
    # may take two steps: the scheduler trims a chunk just past a bucket; a step's tokens are
    # read once the next one is dispatched).
    runners[0].pause_after = 6

    async def main():
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        received = 0
        async for out in engine.generate([500] * 20, params):
            received += len(out.outputs[0].token_ids)
            if received >= 3:
                seen["req"] = engine.engine.requests[out.request_id]
                break  # what a client disconnect does

    try:
        asyncio.run(asyncio.wait_for(main(), 30))  # a stall fails the test, never hangs it
        runners[0].unpause()
        assert wait_until(lambda: not engine.engine.has_unfinished() and all_free(engine))
        seq = seen["req"].seqs[0]
        assert seq.finish_reason == "abort" and seq.num_output_tokens < 100
    finally:
        runners[0].gate.set()
        engine.shutdown()


def test_rejections_before_queueing(tokenizer):
    engine, _ = make_engine(tokenizer)

    async def main():
        with pytest.raises(RequestRejected, match="maximum context length is 128"):
            await collect(engine, [5] * 100, SamplingParams(max_tokens=50))
        with pytest.raises(RequestRejected, match="empty"):
            await collect(engine, [], P)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_full_waiting_queue_is_refused(tokenizer):
    engine, runners = make_engine(tokenizer, max_waiting_requests=2)
    runners[0].gate.clear()  # the engine thread blocks inside its first step

    async def main():
        tasks = [asyncio.create_task(collect(engine, [9, 9], P))]
        # Waits on state, not time: the first request is inside the blocked step, then two
        # more are waiting.
        assert await asyncio.to_thread(wait_until, lambda: runners[0].calls == 1)
        tasks += [asyncio.create_task(collect(engine, [9, 9], P)) for _ in range(2)]
        assert await asyncio.to_thread(wait_until, lambda: engine.num_waiting == 2)
        with pytest.raises(EngineOverloaded, match="limit 2"):
            await collect(engine, [9, 9], P)
        runners[0].gate.set()
        for t in tasks:
            assert (await t)[-1].finished

    try:
        asyncio.run(main())
    finally:
        runners[0].gate.set()
        engine.shutdown()


def test_dead_engine_fails_requests_and_reboots(tokenizer, caplog):
    engine, runners = make_engine(tokenizer, name="victim")
    caplog.set_level(logging.INFO, logger="engine.engine_thread")

    async def main():
        runners[0].fail_next = True
        with pytest.raises(EngineDeadError, match="injected fault"):
            await collect(engine, [42, 43], SamplingParams(max_tokens=20, ignore_eos=True))
        assert wait_until(lambda: engine.alive)
        outs = await collect(engine, [42, 43], P)  # served by the rebuilt engine
        assert whole(outs).outputs[0].token_ids == [44, 45, 46, 47, 48]

    try:
        asyncio.run(main())
        assert engine.num_restarts == 1 and len(runners) == 2
        assert "Engine victim is dead, rebooting" in caplog.text
        assert "Successfully rebooted engine victim" in caplog.text
    finally:
        engine.shutdown()


def test_several_models_by_name(tokenizer):
    a, _ = make_engine(tokenizer, name="a", step=1)
    b, _ = make_engine(tokenizer, name="b", step=2)
    engines = Engines({"a": a, "b": b})

    async def main():
        ra, rb = await asyncio.gather(collect(engines["a"], [10], P),
                                      collect(engines["b"], [10], P))
        assert whole(ra).outputs[0].token_ids == [11, 12, 13, 14, 15]
        assert whole(rb).outputs[0].token_ids == [12, 14, 16, 18, 20]

    try:
        asyncio.run(main())
        with pytest.raises(UnknownModel, match="'c' does not exist"):
            engines["c"]
        assert engines.names() == ["a", "b"]
    finally:
        engines.shutdown()


def test_a_lost_follower_fails_requests_while_the_engine_thread_is_stuck(tokenizer,
                                                                         monkeypatch):
    """Multi-host: the engine thread can block for good in a collective with a dead peer;
    the step channel's watcher must still fail the in-flight request and refuse new ones."""
    from servers import free_port

    from engine import cluster

    monkeypatch.setenv("XLASERVE_CLUSTER_KEY", "a-test-secret-0123456789abcdef")
    coordinator = f"127.0.0.1:{free_port(consecutive=2)}"
    follower = []

    def connect_when_listening():
        follower.append(cluster.connect(coordinator, retry_for=30))

    connect = threading.Thread(target=connect_when_listening, daemon=True)
    connect.start()
    leader = cluster.Leader(coordinator, num_followers=1, timeout=30)
    connect.join()
    monkeypatch.setattr(cluster, "leader", leader)
    engine, runners = make_engine(tokenizer)
    runners[0].pause_after = 2  # the 2nd step never returns, like a collective with a dead peer

    async def main():
        stream = await engine.add_request([7] * 5, SamplingParams(max_tokens=50,
                                                                  ignore_eos=True))
        # The follower dies once the engine thread is stuck in its 2nd step (waiting on that
        # state, not on time or on a token count: closing earlier raced the thread there).
        assert await asyncio.to_thread(runners[0].paused.wait, 30)
        follower[0].close()
        with pytest.raises(EngineDeadError, match=r"cluster lost \(follower 1 disconnected\)"):
            async for _ in stream:
                pass
        assert not engine.stats().alive
        with pytest.raises(EngineDeadError, match="cluster lost"):
            await engine.add_request([7], SamplingParams(max_tokens=1))

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert runners[0].calls == 2 and not runners[0].gate.is_set()  # still stuck
    finally:
        runners[0].gate.set()
        engine.shutdown()


def test_a_reboot_frees_the_dead_engines_device_memory_first(default_gguf):
    """Weights and KV pages of the dead engine are gone before the next one is built, so
    live device bytes never hold two engines (at --gpu-memory-utilization 0.9 that would
    not fit)."""
    import gc

    import jax

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    def live_bytes() -> int:
        gc.collect()  # an earlier test's engine, unreachable but not yet collected, is not ours
        return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())

    before_build = live_bytes()
    seen: dict[str, int] = {}
    engines: list[LLMEngine] = []

    def factory(cfg):
        if engines:  # the rebuild: what is still alive of the dead engine
            seen["at_rebuild"] = live_bytes()
        engines.append(LLMEngine(cfg))
        return engines[-1]

    cfg = EngineConfig(model=str(default_gguf), dtype="float32", max_model_len=64,
                       max_num_seqs=2, max_num_batched_tokens=8, num_blocks=64)
    engine = AsyncEngine(cfg, factory)
    one_engine = live_bytes() - before_build
    runner = engines[0].runner
    assert one_engine >= runner.kv_bytes() + runner.weight_bytes  # KV pages and weights
    submit = runner.submit

    def fail_once(batch):
        runner.submit = submit
        raise RuntimeError("injected fault")

    runner.submit = fail_once

    async def main():
        with pytest.raises(EngineDeadError, match="injected fault"):
            await collect(engine, [42, 43], SamplingParams(max_tokens=4, ignore_eos=True))
        assert wait_until(lambda: engine.alive, timeout=300)
        outs = await collect(engine, [42, 43], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(whole(outs).outputs[0].token_ids) == 4

    try:
        asyncio.run(main())
        assert engine.num_restarts == 1
        assert seen["at_rebuild"] - before_build < 0.1 * one_engine
        assert live_bytes() - before_build < 1.1 * one_engine
    finally:
        engine.shutdown()


def test_a_grammar_that_compiles_too_long_is_refused_and_nothing_is_queued(tokenizer,
                                                                           monkeypatch):
    import engine.async_engine as async_engine
    from engine.grammar import GrammarError
    from engine.sampling_params import StructuredOutputsParams

    engine, _ = make_engine(tokenizer)
    release = threading.Event()
    real = engine.engine.grammars.compile
    # A compile that holds until the test lets it go (state, not a clock): past the limit.
    monkeypatch.setattr(engine.engine.grammars, "compile",
                        lambda spec: (release.wait(), real(spec))[1])
    monkeypatch.setattr(async_engine, "COMPILE_TIMEOUT_S", 0.05)
    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="a+"))

    async def add():
        try:
            await engine.add_request([1000], params)
        finally:
            release.set()  # (asyncio.run waits for the executor's threads as it ends)

    try:
        with pytest.raises(GrammarError, match="longer than 0.05 s"):
            asyncio.run(add())
        assert engine.num_waiting == 0 and not engine.engine.has_unfinished()
    finally:
        release.set()
        engine.shutdown()
