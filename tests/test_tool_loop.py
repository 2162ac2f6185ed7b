"""The server-side tool loop (engine/tool_loop.py, server/tool_rounds.py) on a live `python -m
server` running the default model with `--mcp-config`: a real MCP server from the package
index (`mcp-server-time`) and one of ours (tests/mcp_test_server.py) over stdio. Calls
forced by the grammar (`tool_choice` required or a named tool) run the loop to the round
cap; a tool that fails or hangs gives the model an error result and the request still ends;
a client that leaves stops the loop and frees its blocks; nothing compiles after warmup.
The server's own MCP endpoint (/mcp) through the SDK's client is here too, and, on the same
server's 2,048-token context, a long stored conversation whose second turn comes from the
prefix cache."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import httpx2
import openai
import pytest
from conftest import SERVER_KEY, default_model_server
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from test_server_openai import metrics, wait_for

ROUNDS = 1
TIMEOUT = 2.0
ECHO = {"type": "function", "function": {"name": "echo"}}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, default_gguf):
    tmp = tmp_path_factory.mktemp("tools")
    config = tmp / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {
        "time": {"command": sys.executable,
                 "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]},
        "test": {"command": sys.executable,
                 "args": [str(Path(__file__).with_name("mcp_test_server.py"))]}}}))
    with default_model_server(tmp / "server.log", "--max-model-len=2048",
                              f"--mcp-config={config}", f"--max-tool-rounds={ROUNDS}",
                              f"--tool-timeout={TIMEOUT}") as url:
        yield url


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server}/v1", api_key=SERVER_KEY, max_retries=0)


def named(name: str) -> dict:
    return {"type": "function", "name": name}


def respond(client, **kwargs):
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_output_tokens", 400)
    return client.responses.create(**kwargs)


def mcp_calls(response) -> list:
    return [item for item in response.output if item.type == "mcp_call"]


def error_text(call) -> str:
    assert call.error.type == "mcp_tool_execution_error"
    return call.error.content[0]["text"]


def test_required_calls_run_the_loop_to_the_cap(client, tool_server):
    r = respond(client, input="What time is it in London?", tool_choice="required")
    calls = mcp_calls(r)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_tool_calls"
    # each of the ROUNDS rounds ran its calls; the round after them is not run
    assert len(calls) >= ROUNDS
    for call in calls:
        assert call.server_label in ("time", "test") and call.status in ("completed", "failed")
        assert (call.output is None) != (call.error is None)
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert metrics(tool_server)["compilations_after_warmup_total"] == 0


def test_a_real_mcp_server_answers(client):
    r = respond(client, input="What time is it in UTC?", tool_choice=named("get_current_time"))
    calls = mcp_calls(r)
    assert calls and calls[0].name == "get_current_time" and calls[0].server_label == "time"
    assert "timezone" in json.loads(calls[0].arguments)
    # a time for a time zone the model named, or the server's error for one it does not know
    answer = calls[0].output or error_text(calls[0])
    assert "datetime" in answer or "timezone" in answer.lower(), answer


def test_a_failing_tool_is_an_error_result_and_the_request_ends(client):
    r = respond(client, input="Do the thing.", tool_choice=named("fail"))
    calls = mcp_calls(r)
    assert len(calls) == ROUNDS and all(c.status == "failed" for c in calls)
    assert "could not do it" in error_text(calls[0])
    assert r.status == "incomplete"


def test_a_hanging_tool_times_out_and_the_request_ends(client, tmp_path):
    r = respond(client, input="Wait for it.", tool_choice=named("hang"))
    calls = mcp_calls(r)
    assert calls and all(c.status == "failed" for c in calls)
    assert f"timed out after {TIMEOUT:g} s" in error_text(calls[0])


def test_streamed_events_show_each_call(client):
    events = list(client.responses.create(
        input="Echo hello.", tool_choice=named("echo"), temperature=0.0,
        max_output_tokens=400, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    calls = mcp_calls(final)
    assert len(calls) == ROUNDS and all(c.status == "completed" for c in calls)
    for call in calls:
        assert call.output == json.loads(call.arguments).get("text", "")
        added = [e for e in events if e.type == "response.output_item.added"
                 and e.item.id == call.id]
        done = [e for e in events if e.type == "response.output_item.done"
                and e.item.id == call.id]
        assert len(added) == len(done) == 1 and done[0].item.output == call.output
        assert "response.mcp_call.completed" in kinds[kinds.index("response.output_item.added",
                                                                   events.index(added[0])):]


def test_chat_completions_run_the_loop_too(client):
    model = client.models.list().data[0].id
    one = client.chat.completions.create(
        model=model, temperature=0.0, max_completion_tokens=400, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "noop", "parameters": {}}}],
        messages=[{"role": "user", "content": "Echo hello."}])
    looped = client.chat.completions.create(
        model=model, temperature=0.0, max_completion_tokens=400, tool_choice=ECHO,
        messages=[{"role": "user", "content": "Echo hello."}])
    choice = looped.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    # ROUNDS + 1 rounds, each a prompt longer than the last
    assert looped.usage.prompt_tokens > (ROUNDS + 1) * one.usage.prompt_tokens
    streamed = client.chat.completions.create(
        model=model, temperature=0.0, max_completion_tokens=400, tool_choice=ECHO,
        messages=[{"role": "user", "content": "Echo hello."}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(streamed)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == ["length"]
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.prompt_tokens == looped.usage.prompt_tokens


def test_the_client_s_own_tools_come_back_to_it(client):
    r = respond(client, input="What is the weather in Paris?", tool_choice="required",
                tools=[{"type": "function", "name": "get_weather", "parameters": {
                    "type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}}], parallel_tool_calls=False)
    kinds = {item.type for item in r.output}
    assert kinds <= {"function_call", "mcp_call", "message"}
    clash = httpx.post(f"{client.base_url}responses", headers={
        "Authorization": f"Bearer {SERVER_KEY}"}, json={
        "input": "hi", "tools": [{"type": "function", "name": "echo"}]}, timeout=30)
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "tools"


def test_a_client_that_leaves_stops_the_loop(client, tool_server, tmp_path):
    marker = tmp_path / "marker"
    url = f"{tool_server}/v1/responses"

    async def leave_during_the_call():
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", url, headers={"Authorization": f"Bearer {SERVER_KEY}"},
                                   json={"input": f"Hang with marker {marker}.",
                                         "tool_choice": named("hang"), "temperature": 0.0,
                                         "max_output_tokens": 400, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if "response.mcp_call.in_progress" in line:
                        return True  # leaves: the stream is closed mid-call
        return False

    assert asyncio.run(leave_during_the_call())

    def idle():
        m = metrics(tool_server)
        return (m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
                and m["num_free_kv_blocks"] == m["num_kv_blocks"])

    assert asyncio.run(wait_for(idle, timeout=60))


# ---- the server's own MCP endpoint ---------------------------------------------------------


def test_the_mcp_endpoint_serves_the_model(tool_server):
    async def go():
        headers = {"Authorization": f"Bearer {SERVER_KEY}"}
        async with httpx2.AsyncClient(headers=headers, timeout=60) as http:
            async with Client(streamable_http_client(f"{tool_server}/mcp",
                                                     http_client=http)) as mcp:
                tools = (await mcp.list_tools()).tools
                result = await mcp.call_tool(tools[0].name, {"prompt": "Say hi.",
                                                             "max_tokens": 8})
                return tools, result

    tools, result = asyncio.run(go())
    assert len(tools) == 1 and not result.is_error and result.content[0].text
    wrong = httpx.post(f"{tool_server}/mcp", headers={"Authorization": "Bearer wrong"},
                       json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert wrong.status_code == 401


# ---- a long conversation: the second turn from the prefix cache ------------------------------


def _first_token_seconds(client, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    first = final = None
    for event in client.responses.create(stream=True, **kwargs):
        if first is None and event.type == "response.output_text.delta":
            first = time.perf_counter() - start
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return first, final


def test_a_long_conversation_continues_from_the_cache(client):
    text = " ".join(f"Section {i}: the river town kept its {i} lanterns lit through the "
                    f"winter, and each keeper wrote the night's weather in a ledger."
                    for i in range(60))
    # tool_choice none: the server's tools are not offered (their prompt would not fit)
    kw = dict(temperature=0.0, max_output_tokens=8, tool_choice="none",
              extra_body={"ignore_eos": True})
    first_ttft, first = _first_token_seconds(
        client, input=f"Read this and remember it.\n\n{text}", **kw)
    assert first.usage.input_tokens >= 1500
    second_ttft, second = _first_token_seconds(
        client, input="What was the town called?", previous_response_id=first.id, **kw)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 0.95 * first.usage.input_tokens, (cached, first.usage.input_tokens)
    print(f"cached {cached} of {first.usage.input_tokens}; first tokens {first_ttft:.3f} s, "
          f"then {second_ttft:.3f} s")
    # A turn's prefill against one chunk of new tokens: a ratio, not a speed
    assert second_ttft <= 0.25 * first_ttft, (second_ttft, first_ttft)
