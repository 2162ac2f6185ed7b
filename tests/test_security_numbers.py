"""Every number a request carries is bounded where it enters: the engine's sampling parameters
by the dtypes of the columns that hold them (engine/sampling_params.py), the HTTP requests by
the bounds /openapi.json shows. The extreme value of every numeric field of every route, and
one past it, never reaches the engine thread as something it cannot hold: no engine restart.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from fakes import make_engine, serving
from test_bad_input import ROUTES, holds_nothing, post, with_value

from engine.async_engine import Engines
from engine.outputs import accumulate
from engine.sampling_params import INT_MAX, SamplingParams, SamplingParamsError


async def _finish(engine, params: SamplingParams, **kwargs):
    """The whole output of one request (its stream carries deltas)."""
    stream = await engine.add_request([1, 2, 3], params, **kwargs)
    whole = None
    async for out in stream:
        whole = accumulate(whole, out)
        if out.finished:
            return whole
    raise AssertionError("the stream ended without a finished output")


@pytest.mark.parametrize("field", ["top_k", "min_tokens", "max_tokens", "stop_token_ids"])
def test_an_integer_past_the_engines_columns_is_refused_at_construction(field):
    value = [INT_MAX + 1] if field == "stop_token_ids" else INT_MAX + 1
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


@pytest.mark.parametrize("field,value", [("top_k", "5"), ("temperature", "1"), ("n", 1.5),
                                         ("max_tokens", True), ("stop_token_ids", ["1"])])
def test_a_value_of_the_wrong_type_is_refused_at_construction(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_the_largest_values_run_and_the_engine_never_restarts(tokenizer):
    """What the engine accepts it can hold: the largest top_k and stop token id run through
    the engine's int32 columns, and a cache salt that is no Unicode text (a caller outside
    the server can pass one) is hashed, not fatal."""
    engine, _ = make_engine(tokenizer)
    try:
        async def run():
            biggest = SamplingParams(top_k=INT_MAX, stop_token_ids=(INT_MAX,), max_tokens=4,
                                     min_tokens=2, temperature=0.5, seed=2**63 - 1)
            out = await _finish(engine, biggest)
            assert len(out.outputs[0].token_ids) == 4
            out = await _finish(engine, SamplingParams(max_tokens=2), cache_salt="\ud800")
            assert len(out.outputs[0].token_ids) == 2

        asyncio.run(run())
        assert engine.num_restarts == 0 and engine.alive
    finally:
        engine.shutdown()


def _numeric_fields(schema: dict, defs: dict, path: tuple = ()):
    """(path, schema) of every integer or number in a request schema (0 indexes a list)."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key, []):
            yield from _numeric_fields(sub, defs, path)
    if schema.get("type") in ("integer", "number"):
        yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _numeric_fields(sub, defs, path + (name,))
    if isinstance(schema.get("items"), dict):
        yield from _numeric_fields(schema["items"], defs, path + (0,))


def _extremes(schema: dict) -> list:
    """Values at and past the field's bounds, and past any machine integer or float."""
    integer = schema["type"] == "integer"
    step = 1 if integer else 1e-6
    values = [2**31, 2**63, -(2**63) - 1, 10**30] if integer else [1e308, -1e308, 5e-324]
    for bound, sign in (("maximum", 1), ("minimum", -1)):
        if bound in schema:
            values += [schema[bound], schema[bound] + sign * step]
    for bound in ("exclusiveMaximum", "exclusiveMinimum"):
        if bound in schema:
            values.append(schema[bound])
    return [v for v in values if not isinstance(v, float) or math.isfinite(v)]


def test_every_numeric_field_at_and_past_its_bounds_is_a_4xx_or_served(tokenizer):
    """Each numeric field /openapi.json shows, in each route's bodies, at its bounds and past
    them: a 4xx in OpenAI's shape or a served 200, never a 5xx; the engine never restarts and
    ends holding nothing."""
    engine, _ = make_engine(tokenizer, name="fake", max_model_len=512, max_waiting_requests=64)
    try:
        with serving(Engines({"fake": engine}), max_body_bytes=1 << 20) as url:
            import httpx

            with httpx.Client(base_url=url, timeout=30) as client:
                spec = client.get("/openapi.json").json()
                defs = spec["components"]["schemas"]
                sent = 0
                for route in ROUTES:
                    body = spec["paths"][route]["post"]["requestBody"]["content"][
                        "application/json"]["schema"]
                    fields = list(_numeric_fields(body, defs))
                    assert fields or route in ("/tokenize", "/detokenize"), route
                    for path, schema in fields:
                        for value in _extremes(schema):
                            for base in range(len(ROUTES[route][1])):
                                post(client, route, with_value(route, base, path, value))
                                sent += 1
                assert sent > 200
                holds_nothing(client, engine)
    finally:
        engine.shutdown()
