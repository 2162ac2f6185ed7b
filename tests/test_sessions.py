"""The session store (engine/sessions.py): stored responses bounded by count, bytes and idle
time, least recently used out first, and small enough that 10,000 of them fit in 50 MB."""

from __future__ import annotations

import gc
import json
import uuid

import pytest

from engine.sessions import SessionStore, StoredResponse


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _stored(i: int, words: int = 10) -> StoredResponse:
    text = " ".join(f"word{i}-{j}" for j in range(words))
    response = {"id": f"resp_{i}", "object": "response", "status": "completed",
                "output": [{"type": "message", "id": f"msg_{uuid.uuid4().hex}",
                            "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": text,
                                         "annotations": []}]}]}
    messages = [{"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": text}]
    return StoredResponse(response, messages)


def test_put_get_delete_round_trip():
    store = SessionStore()
    stored = _stored(1)
    assert store.put("resp_1", stored)
    assert store.get("resp_1") == stored
    assert store.get("resp_2") is None
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.get("resp_1") is None and len(store) == 0 and store.nbytes == 0


def test_count_limit_drops_the_least_recently_used():
    store = SessionStore(max_responses=3)
    for i in range(3):
        store.put(f"r{i}", _stored(i))
    store.get("r0")  # r0 is now the most recently used; r1 the least
    store.put("r3", _stored(3))
    assert [k for k in ("r0", "r1", "r2", "r3") if store.get(k) is not None] == ["r0", "r2", "r3"]
    assert store.evicted == 1


def test_byte_limit_is_exact():
    one = len(json.dumps({"response": _stored(0).response, "messages": _stored(0).messages},
                         ensure_ascii=False, separators=(",", ":")).encode())
    store = SessionStore(max_bytes=2 * one + one // 2)
    for i in range(3):  # same-sized records (one digit ids)
        store.put(f"r{i}", _stored(i))
    assert len(store) == 2 and store.nbytes == 2 * one
    assert store.get("r0") is None
    assert not store.put("big", _stored(9, words=10_000))  # larger than the whole store
    assert store.get("big") is None and len(store) == 2


def test_idle_records_expire():
    clock = Clock()
    store = SessionStore(ttl_s=60, clock=clock)
    store.put("a", _stored(1))
    store.put("b", _stored(2))
    clock.now = 50
    assert store.get("a") is not None  # read: its idle time starts again
    clock.now = 100
    assert store.get("b") is None  # unread for 100 s
    assert store.get("a") is not None  # read 50 s ago
    clock.now = 200
    assert store.get("a") is None and len(store) == 0 and store.nbytes == 0


def test_replacing_a_record_counts_its_bytes_once():
    store = SessionStore()
    store.put("a", _stored(1))
    size = store.nbytes
    store.put("a", _stored(1))
    assert store.nbytes == size and len(store) == 1


@pytest.mark.parametrize("limits", [dict(max_responses=-1), dict(max_bytes=-1),
                                    dict(ttl_s=0)])
def test_bad_limits_are_refused(limits):
    with pytest.raises(ValueError):
        SessionStore(**limits)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_ten_thousand_stored_responses_hold_under_50_mb():
    # Responses the size of a short chat turn (a question, a 40-word answer, the response
    # object's fields as the server fills them).
    gc.collect()
    before = _rss()
    store = SessionStore()
    for i in range(10_000):
        stored = _stored(i, words=40)
        stored.response.update(usage={"input_tokens": 30, "output_tokens": 60},
                               tools=[], text={"format": {"type": "text"}}, metadata={})
        assert store.put(f"resp_{uuid.uuid4().hex}", stored)
    gc.collect()
    grown = _rss() - before
    assert len(store) == 10_000
    assert store.nbytes < 50 << 20 and grown < 50 << 20, (store.nbytes, grown)


# ---- the KV blocks a stored conversation keeps (a live server over the fake runner) --------


def test_a_stored_conversation_keeps_its_blocks_past_other_traffic(tokenizer):
    import httpx
    from fakes import assert_holds_nothing, make_engine, serving, wait_until

    from engine.async_engine import Engines

    engine, _ = make_engine(tokenizer, max_model_len=512, num_blocks=48)
    text = lambda i: " ".join(f"word{i}x{j}" for j in range(60))  # noqa: E731 (~200 tokens)
    try:
        with serving(Engines({"fake": engine})) as url, httpx.Client(base_url=url,
                                                                        timeout=60) as http:
            def respond(**body):
                r = http.post("/v1/responses", json={"max_output_tokens": 2, **body})
                assert r.status_code == 200, r.text
                return r.json()

            stored = respond(input=text(0))
            unstored = respond(input=text(1), store=False)
            bm = engine.engine.block_manager
            assert wait_until(lambda: bm.num_kept_blocks > 0)
            for i in range(2, 12):  # ten others, ~13 blocks each, through a 47-block pool
                respond(input=text(i), store=False)
            again = respond(input=text(1), store=False)
            # evicted, but for the template's opening block (the stored one keeps that too)
            assert again["usage"]["input_tokens_details"]["cached_tokens"] <= 16
            nxt = respond(input="and then?", previous_response_id=stored["id"])
            cached = nxt["usage"]["input_tokens_details"]["cached_tokens"]
            prompt = stored["usage"]["input_tokens"]
            assert cached >= prompt - 16, (cached, prompt)
            assert unstored["usage"]["input_tokens"] == prompt
            for r in (stored, nxt):
                assert http.delete(f"/v1/responses/{r['id']}").status_code == 200
            assert wait_until(lambda: bm.num_kept_blocks == 0)
            assert_holds_nothing(url, engine)
    finally:
        engine.shutdown()


def test_stored_responses_survive_an_engine_reboot(tokenizer):
    import httpx
    from fakes import make_engine, serving, wait_until

    from engine.async_engine import Engines

    engine, runners = make_engine(tokenizer, max_model_len=512)
    try:
        with serving(Engines({"fake": engine})) as url, httpx.Client(base_url=url,
                                                                        timeout=60) as http:
            first = http.post("/v1/responses", json={"input": "remember this",
                                                     "max_output_tokens": 2}).json()
            runners[-1].fail_next = True  # the engine thread dies on the next step
            failed = http.post("/v1/responses", json={"input": "boom", "max_output_tokens": 2})
            assert failed.status_code == 503, failed.text
            assert wait_until(lambda: engine.alive and engine.num_restarts == 1, 60)
            nxt = http.post("/v1/responses", json={"input": "and then?", "max_output_tokens": 2,
                                                   "previous_response_id": first["id"]})
            assert nxt.status_code == 200, nxt.text
            assert nxt.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]
            assert http.get(f"/v1/responses/{first['id']}").json()["id"] == first["id"]
    finally:
        engine.shutdown()


def test_a_response_the_store_refuses_keeps_no_blocks(tokenizer):
    import httpx
    from fakes import make_engine, serving, wait_until

    from engine.async_engine import Engines

    engine, _ = make_engine(tokenizer, max_model_len=512)
    try:
        with serving(Engines({"fake": engine}), sessions=SessionStore(max_bytes=100)) as url:
            r = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
            assert httpx.get(f"{url}/v1/responses/{r.json()['id']}").status_code == 404
            bm = engine.engine.block_manager
            assert wait_until(lambda: not engine.engine.has_unfinished()
                              and bm.num_kept_blocks == 0)
    finally:
        engine.shutdown()
