"""A fault under load: the engine thread dies in a step while 24 streams are in flight over a
live server (some running with tokens out, the rest queued). Every stream ends with an
error event and [DONE], none hangs; the engine reboots; new requests are served with the
right tokens; and afterwards every KV block of the rebuilt engine is free."""

from __future__ import annotations

import asyncio
import json

import httpx
from fakes import make_engine, serving, wait_until

from engine.async_engine import Engines

NUM_STREAMS = 24


async def _stream(client: httpx.AsyncClient, prompt: list[int], first: asyncio.Event,
                  max_tokens: int = 100) -> list[dict | str]:
    """The SSE events of one streamed completion (parsed; "[DONE]" as is)."""
    events: list[dict | str] = []
    body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                first.set()
    return events


def test_engine_death_under_load_fails_every_stream_then_serves_again(tokenizer):
    engine, runners = make_engine(tokenizer, name="fake", max_waiting_requests=64)

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            started = [asyncio.Event() for _ in range(NUM_STREAMS)]
            runners[0].pause_after = 6  # the engine stalls in its 6th step ...
            # Prompts 30..53: the fake's next tokens (31.., a few per stream before the
            # fault) are single ASCII characters of this vocabulary (17..110), so the first
            # token read back is text and its chunk goes out. (From id 111 the tokens are
            # lone UTF-8 bytes, held back until they form a character: a stream that only
            # had those would send nothing, and whether one did would depend on timing.)
            tasks = [asyncio.create_task(_stream(client, [30 + i], started[i]))
                     for i in range(NUM_STREAMS)]

            def all_in_flight() -> bool:  # ... until every request is in and some stream
                return (runners[0].paused.is_set() and any(e.is_set() for e in started)
                        and len(engine._streams) == NUM_STREAMS)

            assert await asyncio.to_thread(wait_until, all_in_flight), (
                runners[0].calls, runners[0].paused.is_set(), sum(e.is_set() for e in started),
                len(engine._streams))
            runners[0].fail_next = True  # ... which then fails
            runners[0].unpause()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            for events in results:
                assert events[-1] == "[DONE]", events
                assert events[-2]["error"]["code"] == "engine_unavailable", events[-2]
                assert "injected fault" in events[-2]["error"]["message"]
                assert all("choices" in e for e in events[:-2])
            assert any(len(events) > 2 for events in results)  # mid-stream: tokens came first
            assert wait_until(lambda: engine.alive and engine.num_restarts == 1, 60)

            fresh = [asyncio.Event() for _ in range(8)]
            again = await asyncio.gather(*(_stream(client, [200 + i], fresh[i], max_tokens=5)
                                           for i in range(8)))
            for i, events in enumerate(again):  # the fake model: next token = last + 1
                ids = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
                assert events[-1] == "[DONE]" and ids == list(range(201 + i, 206 + i))
                assert events[-2]["choices"][0]["finish_reason"] == "length"

    try:
        with serving(Engines({"fake": engine})) as url:
            asyncio.run(main(url))
        assert len(runners) == 2  # the dead engine's runner and the rebuilt one
        bm = engine.engine.block_manager
        assert wait_until(lambda: not engine.engine.has_unfinished())
        assert bm.num_free_blocks == bm.num_usable_blocks
        bm.check_invariants()
    finally:
        for r in runners:
            r.gate.set()
        engine.shutdown()
