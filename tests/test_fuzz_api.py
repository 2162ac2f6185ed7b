"""The API under generated input: schemathesis reads the live server's /openapi.json and builds
requests for every operation, positive ones (that follow the schema) and negative ones (that
break it in every way it knows); hypothesis drives them to a live server on 127.0.0.1 (uvicorn,
the whole HTTP stack, the real engine bookkeeping and tokenizer over the fake runner, so a
request costs milliseconds). No response may be a 5xx, at least half of the positive requests
on each generation route must be served (the schema is as strict as the validation), the
server stays up, and afterwards no request is left running and every KV block is free. The
default run sends at least 500 requests; `-m slow` sends several times more.

Each test sends its own requests and checks them itself, so the tests pass in any order."""

from __future__ import annotations

import copy
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from fakes import assert_holds_nothing, make_engine, serving
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from engine.async_engine import Engines

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
MAX_MODEL_LEN = 1024
# The positive requests' max_tokens: the schema allows what fits beside a one-token prompt, but
# a chat's template and tool prompt take up to a few hundred tokens, which no schema can say.
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def live_fake_server(tokenizer):
    """(base URL, AsyncEngine) of a live server for one fake model named "fake", with room for
    a chat that offers tools (the tool prompt alone takes over 100 tokens)."""
    engine, _ = make_engine(tokenizer, name="fake", max_model_len=MAX_MODEL_LEN,
                            max_waiting_requests=64)
    try:
        with serving(Engines({"fake": engine}), max_body_bytes=64 * 1024) as url:
            yield url, engine
    finally:
        engine.shutdown()


def fuzz(url: str, examples: dict[GenerationMode, int]) -> Counter:
    """Send up to `examples[mode]` generated requests per operation and mode; the count of
    answers by (path, mode, status). A 5xx fails at once, with the request to reproduce it."""
    document = httpx.get(f"{url}/openapi.json", timeout=10).json()
    schemas = {GenerationMode.POSITIVE: schemathesis.openapi.from_dict(with_room(document)),
               GenerationMode.NEGATIVE: schemathesis.openapi.from_dict(document)}
    answers: Counter = Counter()
    with requests.Session() as session:
        for mode, n in examples.items():
            for result in schemas[mode].get_all_operations():
                operation = result.ok()
                if mode == GenerationMode.NEGATIVE and not operation.body:
                    continue  # the GET routes take nothing a request could get wrong
                send(operation, mode, n, url, session, answers)
    return answers


def send(operation, mode: GenerationMode, n: int, url: str, session, answers: Counter) -> None:
    @settings(max_examples=n, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case):
        # A hang still fails; the bound is generous so that a 2-core machine running the
        # other tests beside this one (a 30 s bound timed out there once) does not.
        try:
            status = case.call(base_url=url, session=session, timeout=300).status_code
        except requests.Timeout as e:
            raise AssertionError(f"no answer in 300 s to {case.as_curl_command()}") from e
        answers[operation.path, mode, status] += 1
        assert status < 500, f"{status} for {case.as_curl_command()}"

    one()


def with_room(document: dict) -> dict:
    """A copy of the API description whose max_tokens leave a chat's prompt its room, whose
    responses continue no earlier one (a stored response's id), whose requests offer at
    most one tool (tools' names must differ), ask for at most one token at least (min_tokens
    within max_tokens) and no grammar (a random text is no GBNF): what no schema can say."""
    document = copy.deepcopy(document)
    document["components"]["schemas"]["ResponsesRequest"]["properties"][
        "previous_response_id"] = {"type": "null"}
    for model in document["components"]["schemas"].values():
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            for branch in model.get("properties", {}).get(field, {}).get("anyOf", []):
                if "maximum" in branch:
                    branch["maximum"] = MAX_TOKENS
        for branch in model.get("properties", {}).get("tools", {}).get("anyOf", []):
            if branch.get("type") == "array":
                branch["maxItems"] = 1
        if "min_tokens" in model.get("properties", {}):
            model["properties"]["min_tokens"]["maximum"] = 1
        if "oneOf" in model:
            model["oneOf"] = [b for b in model["oneOf"] if b.get("required") != ["grammar"]]
    return document


def check(answers: Counter, url: str, engine, at_least: int) -> None:
    sent = sum(answers.values())
    assert sent >= at_least, f"only {sent} generated requests were sent"
    for path in GENERATION_ROUTES:
        positive = {s: k for (p, m, s), k in answers.items()
                    if p == path and m == GenerationMode.POSITIVE}
        assert positive.get(200, 0) >= sum(positive.values()) / 2, (path, positive)
    negative = Counter()
    for (_, mode, status), k in answers.items():
        if mode == GenerationMode.NEGATIVE:
            negative[status // 100] += k
    assert negative[4] > 0, negative
    assert_holds_nothing(url, engine)


def test_no_generated_request_gets_a_server_error(live_fake_server):
    url, engine = live_fake_server
    answers = fuzz(url, {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 40})
    check(answers, url, engine, at_least=500)


@pytest.mark.slow
def test_many_more_generated_requests_get_no_server_error(live_fake_server):
    url, engine = live_fake_server
    answers = fuzz(url, {GenerationMode.POSITIVE: 600, GenerationMode.NEGATIVE: 400})
    check(answers, url, engine, at_least=3000)
