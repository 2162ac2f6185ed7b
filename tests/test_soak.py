"""A soak against the live server running the default model: many requests with random
lengths and sampling parameters at high concurrency, some aborted mid-stream by the client,
some with bad input. Afterwards every request ended with its tokens or a clear error, no KV
block is held, nothing was compiled, and resident memory did not grow over the second half
(but for the KV pool's blocks written for the first time in it).

The default suite runs a bounded soak (160 requests at concurrency 32); `-m slow` runs the
full one (1,000 requests at concurrency 128)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from conftest import SERVER_KEY
from test_server_openai import idle, metrics, wait_for

from models.known_models import SERVED_NAME

AUTH = {"Authorization": f"Bearer {SERVER_KEY}"}
WORDS = "the sea river light keeper engine token page cache fox dog 42 café 日本".split()
BAD = [  # (body changes, status): bad input mixed into the load
    ({"temperature": -1}, 400), ({"model": "no-such-model"}, 404),
    ({"prompt": ""}, 400), ({"max_tokens": 100_000}, 400), ({"top_p": 7}, 400),
]


def memory(url: str) -> dict:
    """The server's resident bytes, and how many of them its KV pool's written blocks may
    explain: on the CPU a pool page becomes resident when a block in it is first written."""
    m = metrics(url)
    block_bytes = m["kv_cache_bytes"] / (m["num_kv_blocks"] + 1)
    return {"rss": m["process_resident_memory_bytes"],
            "pool": m["num_touched_kv_blocks"] * block_bytes}


def _request(rng: random.Random) -> tuple[dict, str]:
    """A random request and what the client does with it: "read", "abort" or a bad status."""
    body = {"model": SERVED_NAME, "stream": rng.random() < 0.8,
            "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))),
            "max_tokens": rng.randint(1, 16), "temperature": rng.choice([0, 0.5, 1.0]),
            "top_p": rng.choice([1.0, 0.9]), "top_k": rng.choice([0, 20]),
            "presence_penalty": rng.choice([0.0, 0.5]), "seed": rng.choice([None, 3]),
            "logprobs": rng.choice([None, 2])}
    roll = rng.random()
    if roll < 0.05:
        change, status = rng.choice(BAD)
        return {**body, **change}, str(status)
    if roll < 0.15:
        return {**body, "stream": True, "max_tokens": 16, "ignore_eos": True}, "abort"
    return body, "read"


async def _one(client: httpx.AsyncClient, body: dict, plan: str) -> None:
    if plan not in ("read", "abort"):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == int(plan) and set(r.json()["error"]) == {
            "message", "type", "param", "code"}, r.text
        return
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        _check_finish(choice["finish_reason"], r.json()["usage"]["completion_tokens"], body)
        return
    body = {**body, "stream_options": {"include_usage": True}}
    finish, usage, chunks = None, None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            if event["choices"]:
                chunks += 1
                finish = event["choices"][0]["finish_reason"] or finish
            else:
                usage = event["usage"]
            if plan == "abort" and chunks == 2:
                return  # leaving the block closes the connection mid-stream
    _check_finish(finish, usage["completion_tokens"], body)


def _check_finish(finish: str, tokens: int, body: dict) -> None:
    assert (finish == "length" and tokens == body["max_tokens"]
            or finish == "stop" and tokens <= body["max_tokens"]), (finish, tokens, body)


async def _soak(url: str, num_requests: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    plans = [_request(rng) for _ in range(num_requests)]
    todo = iter(plans)
    done = []
    rss = {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300, limits=limits) as c:
        async def worker():
            for body, plan in todo:
                await _one(c, body, plan)
                done.append(plan)
                if len(done) == num_requests // 2:
                    rss["half"] = memory(url)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    rss["end"] = memory(url)
    return {"plans": [p for _, p in plans], "done": done, "rss": rss}


def _run_and_check(live_server, num_requests: int, concurrency: int, seed: int) -> None:
    before = metrics(live_server)
    result = asyncio.run(_soak(live_server, num_requests, concurrency, seed))
    assert len(result["done"]) == num_requests  # every request ended (none hung)
    assert result["plans"].count("abort") >= num_requests // 20
    assert sum(p not in ("read", "abort") for p in result["plans"]) >= 3  # bad input tried
    after = metrics(live_server)
    assert after["compilations_after_warmup_total"] == before["compilations_after_warmup_total"] \
        == 0
    assert after["request_aborts_total"] > before["request_aborts_total"]
    half, end = result["rss"]["half"], result["rss"]["end"]
    # No growth over the second half but the KV pages written for the first time in it.
    growth = end["rss"] - half["rss"] - (end["pool"] - half["pool"])
    assert growth <= 0.10 * half["rss"], (half, end)
    # Aborted streams are freed by the engine thread shortly after the client leaves: wait on
    # that state, then every KV block is back.
    assert asyncio.run(wait_for(lambda: idle(live_server), 60)), metrics(live_server)
    assert metrics(live_server)["kv_cache_usage_perc"] == 0


def test_a_bounded_soak_ends_every_request_and_holds_nothing(live_server):
    _run_and_check(live_server, num_requests=160, concurrency=32, seed=0)


@pytest.mark.slow
def test_a_thousand_requests_at_concurrency_128(live_server):
    _run_and_check(live_server, num_requests=1000, concurrency=128, seed=1)
