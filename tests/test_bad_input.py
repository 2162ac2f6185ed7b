"""Bad input of every kind, sent to a live server on 127.0.0.1 (uvicorn over the fake runner):
any JSON value in any field of any POST route's body (the fields come from the request
models, nested ones included), strings that are not Unicode text (escapes of lone surrogates),
nesting past any parser's depth, numbers past any machine type, NaN, and arbitrary bytes as
the whole body. Every answer is a 4xx in OpenAI's error shape, or a 200 where the body
happens to be valid; the server stays up, its engine never restarts (an engine thread that
died on a bad value would be rebooted and answer 503), and afterwards every KV block is free.

Each test sends its own requests and checks the server itself, so the tests pass in any order.
"""

from __future__ import annotations

import copy
import json
from typing import get_args, get_origin

import httpx
import pytest
from fakes import assert_holds_nothing, make_embedding_engine, make_engine, serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from engine.async_engine import Engines
from server.chat_protocol import ChatCompletionRequest, TokenizeRequest
from server.embeddings import EmbeddingRequest
from server.protocol import CompletionRequest, DetokenizeRequest
from server.responses_protocol import ResponsesRequest
from server.tool_parsers import HermesParser, Llama3JsonParser

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}
# Every POST route: its request model and valid bodies the bad values go into (a plain one,
# and ones that reach the grammar compiler, tool prompts and streaming with the value).
ROUTES = {
    "/v1/completions": (CompletionRequest, [
        {"prompt": "hi", "max_tokens": 2},
        {"prompt": ["hi", "there"], "max_tokens": 2, "n": 2, "logprobs": 2, "echo": True,
         "stream": True, "stream_options": {"include_usage": True},
         "structured_outputs": {"choice": ["a", "b"]}}]),
    "/v1/chat/completions": (ChatCompletionRequest, [
        {"messages": USER, "max_tokens": 2},
        {"messages": USER, "max_tokens": 2, "tools": [TOOL], "tool_choice": "required",
         "stream": True, "logprobs": True, "top_logprobs": 2},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "1", "tool_call_id": "c1"}], "max_tokens": 2,
         "response_format": {"type": "json_schema", "json_schema": {"schema": {
             "type": "object"}}}}]),
    "/v1/responses": (ResponsesRequest, [
        {"input": "hi", "max_output_tokens": 2},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                   {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c1", "output": "1"}],
         "instructions": "be brief", "max_output_tokens": 2, "stream": True,
         "tools": [{"type": "function", "name": "f", "parameters": TOOL["function"][
             "parameters"]}], "tool_choice": "required", "store": False},
        {"input": "hi", "max_output_tokens": 2, "text": {"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "object"}}}}]),
    "/v1/embeddings": (EmbeddingRequest, [
        {"input": "hi"}, {"input": [[1, 2], [3]], "encoding_format": "base64"}]),
    "/tokenize": (TokenizeRequest, [{"prompt": "hi"}, {"messages": USER}]),
    "/detokenize": (DetokenizeRequest, [{"tokens": [1, 2]}]),
}
# A field the models leave to the template (extra="allow"), with its own parsing.
EXTRA_FIELDS = [("/v1/chat/completions", ("messages", 0, "tool_calls"))]


class Raw(str):
    """JSON text put into a body as it is (what json.dumps cannot write)."""


PATHOLOGICAL = [Raw(t) for t in (
    '"\\ud800"', '"a\\udfff"', '"\\udc00\\ud800"', '"\\ud83d"',  # lone surrogates
    '{"\\ud800": 1}',  # ... in a key
    "1e400", "-1e400", "1e-400", "1" + "0" * 400, "-" + "9" * 5000,  # past float, int64, digits
    "NaN", "-Infinity",
    "[" * 201 + "]" * 201, '{"a":' * 1000 + "1" + "}" * 1000,  # past the depth limit
    "[" * 150 + "]" * 150, '{"a":' * 150 + "[1e400]" + "}" * 150,  # under it: reach the
    '{"a": ' + "[" * 150 + "]" * 150 + "}",                         # models, templates, grammars
)]


def dumps(value) -> str:
    if isinstance(value, Raw):
        return value
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)  # (escapes a lone surrogate in a str as \udXXX)


def field_paths(model: type[BaseModel], prefix: tuple = ()) -> list[tuple]:
    """The path of every field of `model`, nested models' fields included (0 indexes a list)."""
    paths = []
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name,)
        paths.append(path)
        for sub, in_list in _models_in(field.annotation):
            paths += field_paths(sub, path + ((0,) if in_list else ()))
    return paths


def _models_in(annotation, in_list: bool = False):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, in_list
        return
    for arg in get_args(annotation):
        yield from _models_in(arg, in_list or get_origin(annotation) is list)


FIELDS = [(route, path) for route, (model, _) in ROUTES.items()
          for path in field_paths(model)] + EXTRA_FIELDS
CASES = [(route, i, path) for route, path in FIELDS for i in range(len(ROUTES[route][1]))]


def with_value(route: str, base: int, path: tuple, value) -> str:
    """The route's valid body number `base` with `value` at `path` (containers made on the
    way)."""
    body = copy.deepcopy(ROUTES[route][1][base])
    node = body
    for key, inner in zip(path, path[1:], strict=False):
        empty = [] if isinstance(inner, int) else {}
        if isinstance(key, int):
            if not node or not isinstance(node[0], type(empty)):
                node[:1] = [empty]
            node = node[0]
        else:
            if not isinstance(node.get(key), type(empty)):
                node[key] = empty
            node = node[key]
    if isinstance(path[-1], int):
        node[:1] = [value]
    else:
        node[path[-1]] = value
    return dumps(body)


texts = st.lists(st.one_of(st.characters(), st.characters(min_codepoint=0xD800,
                                                          max_codepoint=0xDFFF)),
                 max_size=12).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False,
                                                                        allow_infinity=False),
                    texts, st.sampled_from(PATHOLOGICAL))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=12)
bodies = st.one_of(st.binary(max_size=200), st.sampled_from(PATHOLOGICAL).map(str.encode),
                   json_values.map(lambda v: dumps(v).encode("utf-8", "surrogatepass")))
HYPOTHESIS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def live(tokenizer):
    """(httpx client on a live server for a fake model named "fake" and a fake embedding
    model beside it, the fake's AsyncEngine); its context holds a chat with a tool prompt."""
    engine, _ = make_engine(tokenizer, name="fake", max_model_len=512, max_waiting_requests=64)
    embedder, _ = make_embedding_engine(max_waiting_requests=64)
    try:
        with serving(Engines({"fake": engine, "embed": embedder}),
                     max_body_bytes=1 << 20) as url, \
                httpx.Client(base_url=url, timeout=30) as client:
            yield client, engine
    finally:
        engine.shutdown()
        embedder.shutdown()


def post(client: httpx.Client, route: str, body: str | bytes) -> None:
    """Send; the answer must be a served 200 or a 4xx in OpenAI's shape."""
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    r = client.post(route, content=body, headers={"Content-Type": "application/json"})
    shown = f"{route} {body[:300]!r} -> {r.status_code} {r.text[:300]}"
    if r.status_code == 200:
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        if not events:  # a whole answer (a Responses object says "error": null)
            events = [{k: v for k, v in r.json().items() if v is not None}]
        assert not any("error" in event or event.get("type") == "response.failed"
                       for event in events), shown
        return
    assert 400 <= r.status_code < 500, shown
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, shown
    assert isinstance(error["message"], str) and error["message"], shown


def holds_nothing(client: httpx.Client, engine) -> None:
    assert_holds_nothing(str(client.base_url).rstrip("/"), engine)


def test_the_bodies_are_valid_and_cover_every_post_route(live):
    client, engine = live
    paths = client.get("/openapi.json").json()["paths"]
    assert set(ROUTES) == {p for p, ops in paths.items() if "post" in ops}
    for route, (_, bases) in ROUTES.items():
        for body in bases:
            r = client.post(route, json=body)
            assert r.status_code == 200, (route, body, r.text)
            post(client, route, json.dumps(body))  # (and no error inside)
    holds_nothing(client, engine)
    assert ("/v1/chat/completions", ("messages", 0, "content")) in FIELDS
    assert ("/v1/completions", ("structured_outputs", "json")) in FIELDS


def test_pathological_values_in_every_field_are_a_4xx(live):
    client, engine = live
    for route, base, path in CASES:
        for value in PATHOLOGICAL:
            post(client, route, with_value(route, base, path, value))
    holds_nothing(client, engine)


def send_any_values(client: httpx.Client, examples: int, derandomize: bool) -> None:
    @settings(max_examples=examples, derandomize=derandomize, **HYPOTHESIS)
    @given(case=st.sampled_from(CASES), value=json_values)
    def one(case, value):
        post(client, case[0], with_value(*case, value))

    one()


def send_any_bodies(client: httpx.Client, examples: int, derandomize: bool) -> None:
    @settings(max_examples=examples, derandomize=derandomize, **HYPOTHESIS)
    @given(route=st.sampled_from(sorted(ROUTES)), body=bodies)
    def one(route, body):
        post(client, route, body)

    one()


def test_any_json_in_any_field_and_any_body_is_a_4xx(live):
    client, engine = live
    send_any_values(client, 600, derandomize=True)
    send_any_bodies(client, 200, derandomize=True)
    holds_nothing(client, engine)


@pytest.mark.slow
def test_many_more_values_and_bodies_are_a_4xx(live):
    client, engine = live
    send_any_values(client, 5000, derandomize=False)
    send_any_bodies(client, 2000, derandomize=False)
    holds_nothing(client, engine)


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
def test_a_reply_nested_past_the_parser_is_content(parser):
    """A model may write a tool call nested deeper than json can recurse: it is no call."""
    args = "[" * 3000 + "]" * 3000
    for text in (f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>',
                 f'{{"name": "f", "parameters": {{"a": {args}}}}}'):
        assert parser.parse(text)[1] == []
        stream = parser.stream()
        stream.feed(text)
        stream.finish()
        assert stream.calls == []
