"""The API under generated input: schemathesis builds requests from our own /openapi.json
(valid ones and ones that break the schema in every way it knows) and sends them to a live
server on 127.0.0.1 (uvicorn, the whole HTTP stack, the real engine bookkeeping and
tokenizer over the fake runner, so a request costs milliseconds). No response may be a 5xx,
the server must stay up, and afterwards no request is left running and every KV block is
free. The default run sends at least 500 requests; `-m slow` sends several times more."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from fakes import make_engine, serving, wait_until
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error

from engine.async_engine import Engines

SENT: list[int] = []  # status of every generated request, in order


@pytest.fixture(scope="module")
def live_fake_server(tokenizer):
    """(base URL, AsyncEngine) of a live server for one fake model named "fake"."""
    engine, _ = make_engine(tokenizer, name="fake", max_waiting_requests=64)
    try:
        with serving(Engines({"fake": engine}), max_body_bytes=64 * 1024) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(live_fake_server):
    url, _ = live_fake_server
    return schemathesis.openapi.from_url(f"{url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


FUZZ = dict(deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck))


def _send(case, url: str) -> None:
    # max_model_len 128 bounds every generation the fake engine runs
    response = case.call_and_validate(base_url=url, checks=[not_a_server_error], timeout=30)
    SENT.append(response.status_code)


@schema.parametrize()
@settings(max_examples=90, **FUZZ)  # per operation (7 of them)
def test_no_generated_request_gets_a_server_error(case, live_fake_server):
    _send(case, live_fake_server[0])


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=600, **FUZZ)
def test_many_more_generated_requests_get_no_server_error(case, live_fake_server):
    _send(case, live_fake_server[0])


def test_the_server_took_them_all_and_holds_nothing(live_fake_server):
    url, engine = live_fake_server
    assert len(SENT) >= 500, f"only {len(SENT)} generated requests were sent"
    assert not any(s >= 500 for s in SENT)
    assert any(200 <= s < 300 for s in SENT) and any(400 <= s < 500 for s in SENT)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    bm = engine.engine.block_manager
    assert wait_until(lambda: not engine.engine.has_unfinished(), timeout=60)
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()
