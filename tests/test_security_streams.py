"""A client that stops reading a stream costs bounded memory and no engine time: outputs
are deltas (what waits on a stream grows with the new tokens, not with a full copy per
step), a stream's backlog is bounded (merged past a few outputs, the request aborted past
its limit), and a streamed response whose write waits past --stream-stall-timeout is ended
and its request aborted."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import socket
from urllib.parse import urlparse

import httpx
import pytest
from conftest import SERVER_KEY, default_model_server
from fakes import make_engine, wait_until

from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams

N, LOGPROBS, TOKENS = 4, 5, 200
PROMPT = [1000, 2000]


@pytest.fixture
def recorded(monkeypatch):
    """Every (stream, item) the engine thread hands to a stream."""
    seen = []
    put_all = RequestStream.put_all

    def record(items):
        # Copies taken before delivery: the event loop merges a late output into the last
        # waiting one in place, which would count its tokens twice here.
        # Recorded first: a consumer that has read the last output finds it here.
        seen.extend((stream, copy.deepcopy(item)) for stream, item in items)
        put_all(items)

    monkeypatch.setattr(RequestStream, "put_all", staticmethod(record))
    return seen


def _params():
    return SamplingParams(temperature=0, n=N, logprobs=LOGPROBS, max_tokens=TOKENS,
                          ignore_eos=True)


WANT = [PROMPT[-1] + k for k in range(1, TOKENS + 1)]  # the fake runner: previous + 1


def test_outputs_handed_to_a_stream_are_deltas(tokenizer, recorded):
    engine, _ = make_engine(tokenizer, max_model_len=256)

    async def main():
        async for _ in engine.generate(PROMPT, _params()):
            pass

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        items = [item for _, item in recorded]
        assert items and items[-1].finished
        for j in range(N):
            pieces = [c for out in items for c in out.outputs if c.index == j]
            # Each token once over the whole stream, not once per step after it (a full
            # copy per step: TOKENS * (TOKENS + 1) / 2 of them).
            assert sum(len(c.token_ids) for c in pieces) == TOKENS
            assert sum(len(c.logprobs) for c in pieces) == TOKENS
            assert [t for c in pieces for t in c.token_ids] == WANT
            assert [lp.token_id for c in pieces for lp in c.logprobs] == WANT
            assert "".join(c.text for c in pieces) == tokenizer.decode(WANT)
            assert pieces[-1].finish_reason == "length"
    finally:
        engine.shutdown()


def test_a_lagging_consumer_gets_merged_deltas_with_every_token(tokenizer, recorded):
    """Nothing reads until the request is done: what waited was merged, not queued step by
    step, and reading it still gives every token once."""
    engine, _ = make_engine(tokenizer, max_model_len=256)

    async def main():
        stream = await engine.add_request(PROMPT, _params())
        assert await asyncio.to_thread(wait_until, lambda: any(
            item.finished for _, item in recorded))
        await asyncio.sleep(0)  # the loop takes the deliveries scheduled on it
        outs = [out async for out in stream]
        assert outs[-1].finished
        assert len(outs) <= 17  # STREAM_MAX_ITEMS outputs, the rest merged into the last
        for j in range(N):
            assert [t for out in outs for t in out.outputs[j].token_ids] == WANT

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()


def test_a_stream_nobody_reads_is_aborted_past_its_backlog_limit(tokenizer, caplog):
    caplog.set_level(logging.WARNING, logger="engine.request_stream")
    engine, _ = make_engine(tokenizer, max_model_len=256)
    engine.stream_backlog_limit = 500  # token ids + top logprobs: ~20 steps of this request
    bm = engine.engine.block_manager

    async def main():
        stream = await engine.add_request(PROMPT, _params())
        # Nobody reads; the loop runs (it takes the engine thread's deliveries). Aborted, not
        # finished (the request is in the engine only once the engine thread takes it).
        assert await asyncio.to_thread(
            wait_until, lambda: engine.engine.num_aborted == 1
            and not engine.engine.has_unfinished()
            and bm.num_free_blocks == bm.num_usable_blocks)
        assert stream.overflowed and engine.engine.num_aborted == 1
        with pytest.raises(ValueError, match="not read fast enough") as e:
            async for _ in stream:
                pass
        assert type(e.value).__name__ == "StreamBacklogError"
        assert "its client is not reading" in caplog.text

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()


# ---- a live server and a client that stops reading -------------------------------------------

STALL_TIMEOUT = 3.0
MAX_TOKENS = 1000  # the old full copies held ~n * L^2 / 2 references here: ~200 MiB
AUTH = {"Authorization": f"Bearer {SERVER_KEY}"}


@pytest.fixture(scope="module")
def server(default_gguf, tmp_path_factory):
    log = tmp_path_factory.mktemp("streams") / "server.log"
    # The tool loop's length (tests/test_tool_loop.py): one configuration to compile.
    with default_model_server(log, "--max-model-len", "2048",
                              "--stream-stall-timeout", str(STALL_TIMEOUT)) as url:
        yield url, log


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text.splitlines():
        m = re.match(r'^(?:xlaserve:)?(\w+)(?:\{model_name="[^"]+"\})? (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


# Chat: its logprobs carry each token's bytes, so the connection's buffers fill sooner.
BODY = {"messages": [{"role": "user", "content": "Tell me a long story."}], "n": 16,
        "logprobs": True, "top_logprobs": 20, "max_tokens": MAX_TOKENS, "ignore_eos": True,
        "temperature": 1.0, "seed": 7, "stream": True}


def test_a_client_that_stops_reading_is_cut_off_and_its_memory_freed(server):
    url, log = server
    # The same shape once, read to the end: what the process allocates for it is not growth.
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=300,
                      json={**BODY, "max_tokens": 16}) as r:
        assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
    before = _metrics(url)
    addr = urlparse(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its buffers fill sooner
    try:
        sock.connect((addr.hostname, addr.port))
        body = json.dumps(BODY).encode()
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {addr.netloc}\r\n"
                     f"Authorization: Bearer {SERVER_KEY}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        # ... and never reads. It is aborted (not finished: 16,000 tokens take far longer
        # than the connection's buffers do to fill), its KV pages free again.
        aborts = before["request_aborts_total"] + 1
        assert wait_until(lambda: (m := _metrics(url))["request_aborts_total"] == aborts
                          and m["num_requests_running"] == 0
                          and m["num_free_kv_blocks"] == m["num_kv_blocks"], 300, interval=0.2)
        # The server's resident memory (its /proc/self/stat, as /metrics reports it): flat.
        # (Before outputs were deltas it grew by ~240 MiB here and stayed so.)
        rss = [m["process_resident_memory_bytes"] / 2**20 for m in (before, _metrics(url))]
        print(f"server RSS {rss[0]:.0f} MiB -> {rss[1]:.0f} MiB")
        assert rss[1] - rss[0] < 100
        assert wait_until(lambda: "client stopped reading" in log.read_text(), 30, interval=0.2)
        # The server closed the connection: what it had written drains to EOF, unfinished.
        sock.settimeout(60)
        got = b""
        while chunk := sock.recv(1 << 16):
            got += chunk
        assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in got
    finally:
        sock.close()
