"""`python -m engine.bench serve` against a fake streaming OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine.bench import serve as bench_serve

REPO = Path(__file__).resolve().parents[1]


class FakeServer:
    """Streams exactly max_tokens one-token chunks; fails prompts holding `fail_id`, with an
    HTTP 400 or (fail_in_stream) with an error event after a first chunk, as vLLM does."""

    def __init__(self):
        self.active = self.max_active = 0
        self.arrivals: list[float] = []
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.fail_id: int | None = None
        self.fail_word = self.empty_word = None  # embeddings: inputs that fail
        self.fail_in_stream = False
        self.usage = True  # False: a server that never reports usage
        self.merge_last = False  # send the last two tokens as one chunk, as detokenizers may
        self.spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.gate, self.gate_after, self._gate = None, 0, None  # see `hold`
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/metrics", self.metrics),
            Route("/tokenize", self.tokenize, methods=["POST"])])

    async def metrics(self, request: Request):
        from starlette.responses import PlainTextResponse

        lines = [f'xlaserve:spec_decode_{k}_total{{model_name="fake"}} {float(v)}'
                 for k, v in self.spec.items()]
        return PlainTextResponse("\n".join(["# HELP others", "xlaserve:other_total 3.0", *lines]))

    async def chat(self, request: Request):
        """Streams max_tokens one-token deltas; each request counts 2 drafts of 3 tokens, 4
        of them kept, in /metrics."""
        body = await request.json()
        self.bodies.append(body)
        for k, v in (("num_drafts", 2), ("num_draft_tokens", 6), ("num_accepted_tokens", 4)):
            self.spec[k] += v

        async def stream():
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                delta = {"choices": [{"index": 0, "delta": {"content": "y"}}]}
                yield f"data: {json.dumps(delta)}\n\n"
            usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def embeddings(self, request: Request):
        """One 8-float vector per input after 5 ms; usage counts a token per word plus two
        ([CLS], [SEP]). An input holding the word `fail_word` gets an HTTP 400, and one holding
        `empty_word` a 200 without a vector."""
        body = await request.json()
        self.bodies.append(body)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await self.hold()
            await asyncio.sleep(0.005)
        finally:
            self.active -= 1
        words = body["input"].split()
        if self.fail_word in words:
            return JSONResponse({"error": {"message": "marker word in input", "code": 400}},
                                status_code=400)
        vector = [0.125 * i for i in range(8)]
        if body.get("encoding_format") == "base64":
            vector = base64.b64encode(struct.pack("<8f", *vector)).decode()
        data = [] if self.empty_word in words else [
            {"object": "embedding", "index": 0, "embedding": vector}]
        usage = {"prompt_tokens": len(words) + 2, "total_tokens": len(words) + 2}
        return JSONResponse({"object": "list", "model": body["model"], "data": data,
                             "usage": usage})

    async def tokenize(self, request: Request):
        words = (await request.json())["prompt"].split()  # one token per word
        return JSONResponse({"count": len(words), "tokens": list(range(len(words)))})

    async def hold(self):
        """With `gate` set, a request after the first `gate_after` waits until `gate` requests
        are in flight at once (then none waits again): a test then sees the client's
        concurrency reach its bound however slowly the machine runs. A client that never
        reaches it is let through after 30 s, and the test's count shows it."""
        if self.gate is None or len(self.bodies) <= self.gate_after:
            return
        if self._gate is None:
            self._gate = asyncio.Condition()
        gate = self.gate
        async with self._gate:
            self._gate.notify_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gate.wait_for(
                    lambda: self.gate is None or self.active >= gate), 30)
            self.gate = None
            self._gate.notify_all()

    def reset(self, fail_id=None, merge_last=False, fail_in_stream=False, usage=True,
              fail_word=None, empty_word=None, gate=None, gate_after=0):
        self.gate, self.gate_after, self._gate = gate, gate_after, None
        self.active = self.max_active = 0
        self.arrivals, self.bodies, self.headers, self.fail_id = [], [], [], fail_id
        self.fail_word, self.empty_word = fail_word, empty_word
        self.fail_in_stream, self.usage = fail_in_stream, usage
        self.merge_last = merge_last

    async def completions(self, request: Request):
        body = await request.json()
        body["failing"] = self.fail_id is not None and self.fail_id in body["prompt"]
        self.arrivals.append(time.perf_counter())
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if body["failing"] and not self.fail_in_stream:
            return JSONResponse({"error": {"message": "marker id in prompt", "code": 400,
                                           "type": "BadRequestError"}}, status_code=400)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        await self.hold()
        return StreamingResponse(self.stream(body), media_type="text/event-stream")

    async def stream(self, body: dict):
        try:
            empty = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
            yield f"data: {json.dumps(empty)}\n\n"  # no text: neither TTFT nor a token
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
            n_chunks = body["max_tokens"] - (self.merge_last and body["max_tokens"] > 1)
            for i in range(n_chunks):
                await asyncio.sleep(0.002)
                if i == 1 and body["failing"]:
                    error = {"message": "marker id in prompt", "code": 500}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    break
                chunk["choices"][0]["text"] = "xx" if self.merge_last and i == n_chunks - 1 else "x"
                yield f"data: {json.dumps(chunk)}\n\n"
            if self.usage and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": len(body["prompt"]),
                         "completion_tokens": body["max_tokens"],
                         "total_tokens": len(body["prompt"]) + body["max_tokens"]}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.active -= 1


@pytest.fixture(scope="module")
def fake():
    srv = FakeServer()
    server = uvicorn.Server(uvicorn.Config(srv.app, host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    srv.url = f"http://127.0.0.1:{port}"
    yield srv
    server.should_exit = True
    thread.join(timeout=5)


def run_bench(fake, tmp_path, *extra, **server_options):
    fake.reset(**server_options)
    out = tmp_path / "res.json"
    argv = ["--base-url", fake.url, "--model", "fake", "--no-ceilings", "--output", str(out),
            "--num-prompts", "8", "--input-len", "16", "--output-len", "6", *extra]
    rc = bench_serve.main(argv)
    return rc, json.loads(out.read_text()), bench_serve.parse_args(argv)


def test_fixed_lengths_metrics_and_json(fake, tmp_path):
    rc, res, _ = run_bench(fake, tmp_path, "--num-warmups", "2", "--ignore-eos",
                           "--api-key", "sk-secret")
    assert rc == 0 and res["completed"] == 8 and res["failed"] == 0
    assert len(fake.bodies) == 10  # 2 warmups, not counted
    assert res["total_output_tokens"] == 8 * 6 and res["total_input_tokens"] == 8 * 16
    assert res["input_lens"] == [16] * 8
    body = fake.bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["min_tokens"] == body["max_tokens"]
    assert all(100 <= t < 10000 for t in body["prompt"])
    assert all(t <= e for t, e in zip(res["ttfts"], res["e2els"], strict=True))
    assert sum(len(g) for g in res["itls"]) == 8 * (6 - 1)
    gaps = [g for per_request in res["itls"] for g in per_request]
    assert res["mean_itl_ms"] == pytest.approx(1000 * sum(gaps) / len(gaps))
    for key in ("label", "completed", "failed", "duration_s", "max_concurrency", "request_rate",
                "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "host", "cpu_count", "args",
                *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
                  for m in ("ttft", "tpot", "itl", "e2el"))):
        assert key in res, key
    assert res["label"] == "fake" and res["median_tpot_ms"] > 0
    assert fake.headers[-1]["authorization"] == "Bearer sk-secret"
    assert "sk-secret" not in json.dumps(res)  # the key stays out of the results file
    # TTFT is at least one server-side chunk delay; E2EL covers all six chunks.
    assert res["mean_ttft_ms"] >= 2 and res["mean_e2el_ms"] >= 6 * 2


def test_range_ratio_lengths(fake, tmp_path):
    rc, res, args = run_bench(fake, tmp_path, "--range-ratio", "0.5", "--output-len", "12",
                              "--num-warmups", "0")
    want = bench_serve.sample_requests(args, 8, args.seed)
    outs = [r.output_len for r in want]
    assert rc == 0 and min(outs) < max(outs) and min(outs) >= 6
    assert res["total_output_tokens"] == sum(outs)
    assert res["input_lens"] == [len(r.prompt) for r in want]
    assert sum(len(g) for g in res["itls"]) == sum(n - 1 for n in outs)
    assert "ignore_eos" not in fake.bodies[0] and "min_tokens" not in fake.bodies[0]


def test_output_tokens_from_usage_not_chunks(fake, tmp_path):
    rc, res, _ = run_bench(fake, tmp_path, "--num-warmups", "0", merge_last=True)
    assert rc == 0 and res["total_output_tokens"] == 8 * 6  # usage.completion_tokens
    assert sum(len(g) for g in res["itls"]) == 8 * (6 - 2)  # 5 chunks carried the 6 tokens


def test_max_concurrency_bounds_in_flight(fake, tmp_path):
    rc, res, _ = run_bench(fake, tmp_path, "--max-concurrency", "2", "--num-warmups", "0",
                           gate=2)
    assert rc == 0 and res["completed"] == 8 and res["max_concurrency"] == 2
    assert fake.max_active == 2


def test_request_rate_spreads_arrivals(fake, tmp_path):
    n, rate = 11, 20.0
    rc, res, _ = run_bench(fake, tmp_path, "--num-prompts", str(n), "--request-rate", str(rate),
                           "--num-warmups", "0", "--output-len", "2")
    # n - 1 exponential gaps of mean 1/rate: their sum is (n-1)/rate on average.
    assert rc == 0 and res["completed"] == n
    assert res["duration_s"] >= 0.4 * (n - 1) / rate
    assert fake.arrivals[-1] - fake.arrivals[0] >= 0.4 * (n - 1) / rate


@pytest.mark.parametrize("fail_in_stream", [False, True])
def test_failures_counted_and_exit_code(fake, tmp_path, capsys, fail_in_stream):
    args = bench_serve.parse_args(["--base-url", "x", "--model", "m", "--num-prompts", "8",
                                   "--input-len", "16"])
    prompts = [r.prompt for r in bench_serve.sample_requests(args, 8, args.seed)]
    marker = next(t for t in prompts[3] if t not in prompts[0])
    n_bad = sum(marker in p for p in prompts)
    rc, res, _ = run_bench(fake, tmp_path, "--num-warmups", "0", fail_id=marker,
                           fail_in_stream=fail_in_stream)
    assert rc == 1 and res["failed"] == n_bad and res["completed"] == 8 - n_bad
    assert res["total_output_tokens"] == (8 - n_bad) * 6
    assert "marker id in prompt" in capsys.readouterr().err


def test_text_prompt(fake, tmp_path):
    rc, res, _ = run_bench(fake, tmp_path, "--num-warmups", "0", "--prompt", "hello world")
    assert rc == 0 and res["completed"] == 8 and fake.bodies[0]["prompt"] == "hello world"
    assert res["total_input_tokens"] == 8 * len("hello world")  # from the server's usage
    assert res["request_rate"] == "inf"  # strict JSON


def test_text_prompt_without_usage_counts_with_tokenize(fake, tmp_path):
    rc, res, _ = run_bench(fake, tmp_path, "--num-warmups", "0", "--prompt", "hello big world",
                           "--tokenizer-endpoint", usage=False)
    assert rc == 0 and res["total_input_tokens"] == 8 * 3  # the server's /tokenize count
    assert res["total_output_tokens"] == 8 * 6  # one text chunk per token


def test_plot_writes_png(fake, tmp_path):
    png = tmp_path / "lat.png"
    rc, _, _ = run_bench(fake, tmp_path, "--num-warmups", "0", "--plot", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_help_and_no_jax_at_import():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "engine.bench", "serve", "--help"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--max-concurrency" in proc.stdout
    probe = ("import sys, engine.bench.serve, engine.bench.serve_embed; "
             "assert 'jax' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, timeout=60)
    assert proc.returncode == 0


def test_a_dataset_of_conversations_and_the_servers_drafting(fake, tmp_path):
    """--dataset sends each line's messages to /v1/chat/completions (streamed deltas counted
    as text chunks), and the server's spec_decode counters over the run become the acceptance
    rate and mean accepted length."""
    data = tmp_path / "convs.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]})
                              for i in range(3)) + "\n")
    rc, res, _ = run_bench(fake, tmp_path, "--dataset", str(data))
    assert rc == 0 and res["completed"] == 8 and res["total_output_tokens"] == 8 * 6
    assert all(b["messages"][0]["content"].startswith("hi ") for b in fake.bodies)
    assert res["total_input_tokens"] == 8 * 7  # from usage
    # 8 measured requests (the warmup's counts come before the first reading)
    assert res["spec_num_drafts"] == 16 and res["spec_num_draft_tokens"] == 48
    assert res["spec_acceptance_rate"] == pytest.approx(4 / 6)
    assert res["spec_mean_accepted_length"] == pytest.approx(3.0)
    rc, res, _ = run_bench(fake, tmp_path)  # completions: no drafting reported
    assert "spec_num_drafts" not in res


def test_a_datasets_text_lines_are_completions_prompts(fake, tmp_path):
    data = tmp_path / "texts.jsonl"
    data.write_text(json.dumps({"text": "hello there"}) + "\n")
    rc, res, _ = run_bench(fake, tmp_path, "--dataset", str(data))
    assert rc == 0 and res["completed"] == 8 and res["total_output_tokens"] == 8 * 6
    assert all(b["prompt"] == "hello there" for b in fake.bodies)  # to /v1/completions


def test_embeddings_one_text_a_request_texts_and_tokens_a_second(fake, tmp_path, capsys):
    rc, res, args = run_bench(fake, tmp_path, "--task", "embed", "--num-warmups", "2",
                              "--max-concurrency", "3", gate=3, gate_after=2)
    assert rc == 0 and res["completed"] == 8 and res["failed"] == 0
    assert len(fake.bodies) == 10 and fake.max_active == 3  # 2 warmups, not counted
    body = fake.bodies[-1]
    assert set(body) == {"model", "input", "encoding_format"}
    assert body["model"] == "fake" and body["encoding_format"] == "float"
    assert len(body["input"].split()) == 16  # --input-len common words, one text
    assert all(w in bench_serve.WORDS for w in body["input"].split())
    assert res["task"] == "embed" and res["endpoint"] == "/v1/embeddings"
    assert res["embedding_dims"] == [8]
    assert res["input_lens"] == [18] * 8 and res["total_input_tokens"] == 8 * 18  # usage
    assert res["request_throughput"] == pytest.approx(8 / res["duration_s"])
    assert res["total_token_throughput"] == pytest.approx(8 * 18 / res["duration_s"])
    assert 5 <= res["median_e2el_ms"] <= res["p99_e2el_ms"]  # the server's 5 ms and more
    assert res["mean_e2el_ms"] == pytest.approx(1000 * sum(res["e2els"]) / 8)
    out = capsys.readouterr().out
    assert "Embedding Benchmark Result" in out and "Mean E2EL (ms):" in out
    # measured texts differ from the warmups' (no cache serves them)
    assert not {b["input"] for b in fake.bodies[:2]} & {b["input"] for b in fake.bodies[2:]}


def test_embeddings_base64_vectors_are_decoded(fake, tmp_path):
    rc, res, _ = run_bench(fake, tmp_path, "--task", "embed", "--encoding-format", "base64")
    assert rc == 0 and fake.bodies[-1]["encoding_format"] == "base64"
    assert res["embedding_dims"] == [8]  # 32 bytes of float32


@pytest.mark.parametrize("failure", ["fail_word", "empty_word"])
def test_embeddings_failures_counted_and_exit_code(fake, tmp_path, capsys, failure):
    args = bench_serve.parse_args(["--base-url", "x", "--model", "m", "--num-prompts", "8",
                                   "--input-len", "16", "--task", "embed"])
    texts = [r.prompt.split() for r in bench_serve.sample_requests(args, 8, args.seed)]
    marker = next(w for w in texts[3] if w not in texts[0])
    n_bad = sum(marker in t for t in texts)
    rc, res, _ = run_bench(fake, tmp_path, "--task", "embed", "--num-warmups", "0",
                           **{failure: marker})
    assert rc == 1 and res["failed"] == n_bad and res["completed"] == 8 - n_bad
    assert res["total_input_tokens"] == (8 - n_bad) * 18
    err = capsys.readouterr().err
    assert ("HTTP 400" in err) if failure == "fail_word" else ("one vector expected" in err)


def test_embeddings_of_a_datasets_texts_and_conversations(fake, tmp_path):
    data = tmp_path / "texts.jsonl"
    lines = [{"text": "alpha beta"},
             {"messages": [{"role": "user", "content": "one two"},
                           {"role": "assistant", "content": "three"}]}]
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    rc, res, _ = run_bench(fake, tmp_path, "--task", "embed", "--dataset", str(data))
    assert rc == 0 and res["completed"] == 8
    assert {b["input"] for b in fake.bodies} == {"alpha beta", "one two\nthree"}
    assert sorted(set(res["input_lens"])) == [4, 5]


def test_embeddings_endpoint_and_plot_flags(capsys):
    args = bench_serve.parse_args(["--base-url", "x", "--model", "m", "--task", "embed",
                                   "--endpoint", "/embeddings"])
    assert args.endpoint == "/embeddings"
    assert bench_serve.parse_args(["--base-url", "x", "--model", "m"]).endpoint \
        == "/v1/completions"
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--base-url", "x", "--model", "m", "--task", "embed",
                                "--plot", "x.png"])
    assert "--plot" in capsys.readouterr().err
