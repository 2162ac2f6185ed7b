"""The HTTP layer against fake engines (next token = previous + 1): every error case has its
status and the OpenAI error shape, auth and limits hold, and the server keeps serving."""

from __future__ import annotations

import json
import threading

import pytest
from fakes import make_engine, wait_until
from starlette.testclient import TestClient

import server.app
from engine.async_engine import Engines
from server.app import build_app

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def served(tokenizer):
    """(client, engine, runners) for one fake model named 'fake', behind an API key."""
    engine, runners = make_engine(tokenizer, name="fake", max_waiting_requests=1)
    app = build_app(Engines({"fake": engine}), api_key=KEY, max_body_bytes=4096,
                    max_headers=40, cors_origins=["http://ui.example"])
    with TestClient(app, headers=AUTH) as client:
        yield client, engine, runners
    for r in runners:
        r.gate.set()
    engine.shutdown()


def all_free(engine) -> bool:
    bm = engine.engine.block_manager
    return bm.num_free_blocks == bm.num_usable_blocks and not engine.engine.has_unfinished()




def assert_error(r, status, param=None, match=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if match is not None:
        assert match in err["message"], err
    if code is not None:
        assert err["code"] == code, err


def complete(client, **body):
    return client.post("/v1/completions", json={"model": "fake", "max_tokens": 3,
                                                "temperature": 0, "ignore_eos": True, **body})


def test_good_request_tokens_are_the_fake_sequence(served):
    client, engine, _ = served
    r = complete(client, prompt=[100, 200], return_token_ids=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [201, 202, 203] and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 3
    assert wait_until(lambda: all_free(engine))


BAD_REQUESTS = [  # (body, param, words the message must carry)
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature"),
    ({"prompt": "hi", "n": 0}, "n", "n: Input should be greater than or equal to 1"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": "hi", "logit_bias": {"five": 1.0}}, "logit_bias", "logit_bias"),
    ({"prompt": "hi", "n": 129}, "n", "n: Input should be less than or equal to 128"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "best_of"),
    ({"prompt": "hi", "stop": ["a"] * 17}, "stop", "at most 16 items"),
    ({"prompt": "hi", "n": "many"}, "n", "integer"),
    ({"prompt": {"not": "a prompt"}}, "prompt", "prompt"),
    ({"max_tokens": 3}, "prompt", "Field required"),
    ({"prompt": [5, 10**9]}, None, "outside the vocabulary"),
    ({"prompt": [5, -1]}, None, "outside the vocabulary"),
    ({"prompt": ""}, None, "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[]]}, None, "empty"),
    ({"prompt": [7] * 200}, None, "maximum context length is 128 tokens, but the request needs "
                                  "200 prompt tokens + max_tokens 16 = 216"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options",
     "only allowed when stream is true"),
]


@pytest.mark.parametrize("body,param,words", BAD_REQUESTS)
def test_invalid_completion_requests_are_400(served, body, param, words):
    client, engine, _ = served
    r = client.post("/v1/completions", json={"model": "fake", **body})
    assert_error(r, 400, param=param, match=words)
    assert complete(client, prompt=[1]).status_code == 200  # still serving
    assert wait_until(lambda: all_free(engine))


@pytest.mark.parametrize("body,param,words", [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"content": "no role"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs",
     "logprobs: true"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools", "tools.0.function: Field required"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     None, "only allowed when tools are given"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"messages": [{"role": "user", "content": "hi " * 200}]}, None, "maximum context length"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]},
     "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {}},
     "stream_options", "only allowed when stream is true"),
])
def test_invalid_chat_requests_are_400(served, body, param, words):
    client, _, _ = served
    assert_error(client.post("/v1/chat/completions", json={"model": "fake", **body}), 400,
                 param=param, match=words)


def test_every_openai_role_is_accepted(served):
    client, engine, _ = served
    messages = [{"role": "developer", "content": "be brief"}, {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
                {"role": "assistant", "content": "calling f"},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    r = client.post("/v1/chat/completions", json={"model": "fake", "messages": messages,
                                                  "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert wait_until(lambda: all_free(engine))


def test_malformed_bodies_are_400(served):
    client, _, _ = served
    for body in (b"{not json", b"\xff\xfe"):
        r = client.post("/v1/completions", content=body, headers=JSON)
        assert_error(r, 400, match="valid JSON")
    assert_error(client.post("/v1/completions", json=[1, 2]), 400, match="dictionary")
    assert_error(client.post("/tokenize", json={"model": "fake"}), 400, param="prompt")
    assert_error(client.post("/detokenize", json={"model": "fake", "tokens": [10**9]}), 400,
                 match="outside the vocabulary")


def test_a_big_body_is_parsed_and_validated_off_the_event_loop(served, monkeypatch):
    """So that one big body does not stall every stream on the loop while it is parsed."""
    client, engine, _ = served
    threads = []

    def spy(body):
        threads.append(threading.get_ident())
        return parse_json(body)

    parse_json = server.app.parse_json
    monkeypatch.setattr(server.app, "parse_json", spy)
    monkeypatch.setattr(server.app, "PARSE_INLINE_BYTES", 1000)
    assert complete(client, prompt=[1]).status_code == 200  # small: parsed on the loop
    assert_error(complete(client, prompt=[5] * 600), 400, match="maximum context length")
    assert_error(client.post("/v1/completions", content=b"[" * 1500, headers=JSON), 400,
                 match="valid JSON")
    loop_thread = threads[0]
    assert len(threads) == 3 and loop_thread not in threads[1:]
    assert wait_until(lambda: all_free(engine))


def test_unknown_model_route_and_method(served):
    client, _, _ = served
    assert_error(complete(client, prompt="hi", model="gpt-9"), 404, param="model",
                 code="model_not_found", match="'gpt-9' does not exist")
    assert_error(client.get("/v1/models/gpt-9"), 404, code="model_not_found")
    assert_error(client.get("/v1/nothing"), 404, match="no route for GET /v1/nothing")
    assert_error(client.get("/v1/completions"), 405, match="not allowed")
    assert client.get("/v1/models/fake").json()["id"] == "fake"


def test_body_and_header_limits(served):
    client, engine, _ = served
    big = json.dumps({"model": "fake", "prompt": "x" * 5000}).encode()
    assert_error(client.post("/v1/completions", content=big, headers=JSON), 413,
                 match="limit of 4096 bytes")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(10):
            yield b" " * 1000

    assert_error(client.post("/v1/completions", content=chunks(), headers=JSON), 413,
                 match="4096")
    many = {f"x-h{i}": "1" for i in range(50)}
    assert_error(client.get("/v1/models", headers=many), 431, match="too many headers")
    assert complete(client, prompt=[1]).status_code == 200
    assert wait_until(lambda: all_free(engine))


def test_api_key(served):
    client, _, _ = served
    assert client.get("/v1/models").status_code == 200
    for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": ""},
                    {"Authorization": KEY}, {"Authorization": f"bearer {KEY}"}):
        assert_error(client.get("/v1/models", headers=headers), 401, code="invalid_api_key")
    # A forged Host that would make a URL rebuilt from it point at /health.
    for host in ("localhost/health?", "x/health#", "/health"):
        r = client.get("/v1/models", headers={"Authorization": "", "Host": host})
        assert_error(r, 401, code="invalid_api_key")
    for path in ("/metrics", "/openapi.json", "/tokenize", "/health/", "/v1/nothing"):
        assert client.get(path, headers={"Authorization": ""}).status_code == 401, path
    assert client.get("/health", headers={"Authorization": ""}).status_code == 200
    # CORS preflight is answered without a key, for the allowed origin only.
    r = client.options("/v1/models", headers={
        "Authorization": "", "Origin": "http://ui.example",
        "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://ui.example"


def test_full_queue_is_429_and_dead_engine_is_503(served):
    client, engine, runners = served
    runners[0].gate.clear()  # the engine thread stalls inside its next step
    results = []

    def send(prompt):
        results.append(complete(client, prompt=prompt))

    first = threading.Thread(target=send, args=([11],))
    first.start()
    assert wait_until(lambda: engine.engine.scheduler.running)  # taken into a step
    second = threading.Thread(target=send, args=([12],))
    second.start()
    assert wait_until(lambda: engine.num_waiting == 1)  # queued: the limit is 1
    assert_error(complete(client, prompt=[13]), 429, code="rate_limit_exceeded",
                 match="limit 1")
    runners[0].gate.set()
    first.join(10)
    second.join(10)
    assert [r.status_code for r in results] == [200, 200]

    engine.alive = False  # what a reboot looks like from outside
    try:
        assert_error(client.get("/health"), 503, match="not ready")
        assert_error(complete(client, prompt=[1]), 503, match="rebooting")
    finally:
        engine.alive = True
    assert client.get("/health").status_code == 200


def test_engine_failure_mid_stream_is_an_error_event_then_done(served):
    client, engine, runners = served
    # Stall in the 4th step from now (a step's tokens are read once the next one is
    # dispatched, so two outputs are out by then) ...
    runners[0].pause_after = runners[0].calls + 4
    events = []
    with client.stream("POST", "/v1/completions", json={
            "model": "fake", "prompt": [50], "max_tokens": 50, "stream": True,
            "ignore_eos": True, "temperature": 0}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 2:
                # Release it only once it is stuck there: set earlier, the gate would be
                # cleared again by the stalling step and nothing would ever release it.
                assert runners[0].paused.wait(30)
                runners[0].fail_next = True  # ... and fail there
                runners[0].gate.set()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["code"] == "engine_unavailable" and "injected fault" in \
        error["error"]["message"]
    assert all("choices" in json.loads(e.removeprefix("data: ")) for e in events[:-2])
    assert wait_until(lambda: engine.alive and engine.num_restarts == 1)
    assert complete(client, prompt=[7]).json()["choices"][0]["text"] is not None


def test_failure_before_any_output_is_503(served):
    client, engine, runners = served
    runners[0].fail_next = True
    assert_error(complete(client, prompt=[3]), 503, match="injected fault")
    assert wait_until(lambda: engine.alive)


def test_openapi_comes_from_the_request_models(served):
    client, _, _ = served
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert {"prompt", "max_tokens", "logprobs", "stream_options", "ignore_eos"} <= set(
        schemas["CompletionRequest"]["properties"])
    assert {"messages", "max_completion_tokens", "top_logprobs"} <= set(
        schemas["ChatCompletionRequest"]["properties"])
    assert "ChatMessage" in schemas and "/v1/chat/completions" in doc["paths"]
    ref = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert ref["schema"]["$ref"] == "#/components/schemas/CompletionRequest"


def test_openapi_says_what_this_server_takes(served, tokenizer):
    """The validation's bounds, the served model, its context and vocabulary, and the key."""
    client, _, _ = served
    doc = client.get("/openapi.json").json()
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert (completion["n"]["minimum"], completion["n"]["maximum"]) == (1, 128)
    assert completion["model"]["anyOf"] == [{"enum": ["fake"]}, {"type": "null"}]
    assert {"type": "integer", "minimum": 1, "maximum": 127} in completion["max_tokens"]["anyOf"]
    token_ids = completion["prompt"]["anyOf"][2]
    assert token_ids["items"]["maximum"] == tokenizer.vocab_size - 1
    assert token_ids["maxItems"] == 127
    assert doc["security"] == [{"bearer": []}] and doc["paths"]["/health"]["get"]["security"] == []
    assert "security" not in TestClient(build_app(Engines({}))).get("/openapi.json").json()


def test_cache_salt_keeps_prefixes_apart(served):
    """vLLM's `cache_salt`: only requests with the same salt share cached prompt blocks."""
    client, engine, _ = served
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 and a partial one

    def cached(**extra) -> int:
        r = complete(client, prompt=prompt, max_tokens=1, **extra)
        assert r.status_code == 200, r.text
        assert wait_until(lambda: all_free(engine))
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") == 32
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    assert cached() == 32
