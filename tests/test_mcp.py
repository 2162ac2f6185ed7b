"""MCP through the official SDK: the servers whose tools xlaserve runs (server/mcp_tools.py)
against `mcp-server-time` and our own test server (tests/mcp_test_server.py) over stdio, the
config file's errors, and xlaserve's own /mcp endpoint (server/mcp_endpoint.py) against fake
engines, with the SDK's streamable HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import httpx2
import mcp_types
import pytest
from fakes import live, make_engine, wait_until
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine.async_engine import Engines
from server.app import build_app
from server.mcp_config import HttpServer, StdioServer, load_mcp_config, parse_mcp_config
from server.mcp_endpoint import tool_names
from server.mcp_tools import McpTools, _openai_names

TEST_SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
TIME_SERVER = {"command": sys.executable, "args": ["-m", "mcp_server_time",
                                                   "--local-timezone", "UTC"]}
OURS = {"command": sys.executable, "args": [TEST_SERVER]}
KEY = "sk-mcp-test"


@contextlib.asynccontextmanager
async def started(servers: dict, **options):
    """McpTools over `{"mcpServers": servers}`, started (and stopped after)."""
    tools = McpTools(parse_mcp_config({"mcpServers": servers}), **options)
    await tools.start()
    try:
        yield tools
    finally:
        await tools.stop()


async def until(cond, timeout: float = 30.0) -> bool:
    """`wait_until` on the event loop."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.01)
    return True


# ---- tools of MCP servers over stdio ----------------------------------------------------

def test_time_server_tools_and_calls():
    async def main():
        async with started({"time": TIME_SERVER}) as tools:
            by_name = {t["function"]["name"]: t for t in tools.tools}
            assert set(by_name) == {"get_current_time", "convert_time"}
            get = by_name["get_current_time"]
            assert get["type"] == "function" and get["function"]["description"]
            assert get["function"]["parameters"]["required"] == ["timezone"]

            result = await tools.call("get_current_time", {"timezone": "UTC"}, timeout=30)
            assert not result.is_error, result.text
            now = json.loads(result.text)
            assert now["timezone"] == "UTC"
            assert abs(datetime.fromisoformat(now["datetime"]).timestamp() - time.time()) < 600

            bad = await tools.call("get_current_time", {"timezone": "Mars/Olympus"}, timeout=30)
            assert bad.is_error and "Mars/Olympus" in bad.text
            missing = await tools.call("get_current_time", {}, timeout=30)
            assert missing.is_error and "timezone" in missing.text
            unknown = await tools.call("get_the_weather", {}, timeout=30)
            assert unknown.is_error and "unknown tool 'get_the_weather'" in unknown.text
            assert "get_current_time" in unknown.text  # it names what there is
            not_object = await tools.call("get_current_time", ["UTC"], timeout=30)
            assert not_object.is_error and "JSON object" in not_object.text

    asyncio.run(main())


def test_same_tool_on_two_servers_is_prefixed_and_failures_are_results():
    async def main():
        async with started({"a": OURS, "b": OURS, "time": TIME_SERVER}) as tools:
            names = [t["function"]["name"] for t in tools.tools]
            assert "a__echo" in names and "b__echo" in names and "echo" not in names
            assert "get_current_time" in names  # offered once: not prefixed
            assert len(set(names)) == len(names)
            assert tools.server_of("b__echo") == "b"

            for name in ("a__echo", "b__echo"):
                echo = await tools.call(name, {"text": "hello"}, timeout=30)
                assert (echo.text, echo.is_error) == ("hello", False)

            fail = await tools.call("a__fail", {"reason": "no paper"}, timeout=30)
            assert fail.is_error and "could not do it: no paper" in fail.text
            crash = await tools.call("a__crash", {}, timeout=30)
            assert crash.is_error and "secret" not in crash.text  # the SDK withholds it

            t0 = time.monotonic()
            hung = await tools.call("a__hang", {}, timeout=0.5)
            assert time.monotonic() - t0 < 10  # (a generous bound: the call returned)
            assert hung.is_error and hung.text == "tool 'a__hang' timed out after 0.5 s"
            after = await tools.call("a__echo", {"text": "still here"}, timeout=30)
            assert (after.text, after.is_error) == ("still here", False)

    asyncio.run(main())


def test_a_cancelled_call_is_cancelled_on_the_server_and_the_session_goes_on(tmp_path):
    marker = tmp_path / "cancelled"

    async def main():
        async with started({"ours": OURS}) as tools:
            # A request handler's task, cancelled when its client goes away.
            call = asyncio.create_task(tools.call("hang", {"marker": str(marker)}, timeout=60))
            assert await until(lambda: marker.exists())  # the tool is running
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # The server heard: its handler was cancelled.
            assert await until(lambda: marker.read_text() == "cancelled")
            echo = await tools.call("echo", {"text": "next"}, timeout=30)
            assert (echo.text, echo.is_error) == ("next", False)

    asyncio.run(main())


def test_calls_from_other_tasks_and_concurrent_calls():
    """start and stop in one task, calls from others (request handlers), many at once."""
    async def main():
        tools = McpTools(parse_mcp_config({"mcpServers": {"ours": OURS}}))
        await asyncio.create_task(tools.start())
        texts = [f"n{i}" for i in range(20)]
        results = await asyncio.gather(*(asyncio.create_task(
            tools.call("echo", {"text": t}, timeout=30)) for t in texts))
        assert [r.text for r in results] == texts
        await asyncio.create_task(tools.stop())
        gone = await tools.call("echo", {"text": "x"}, timeout=30)
        assert gone.is_error

    asyncio.run(main())


def test_a_server_that_dies_gives_error_results_and_the_others_go_on():
    async def main():
        async with started({"mortal": OURS, "time": TIME_SERVER}) as tools:
            died = await tools.call("die", {}, timeout=30)
            assert died.is_error and "'mortal'" in died.text
            again = await tools.call("echo", {"text": "x"}, timeout=30)
            assert again.is_error and "closed" in again.text
            now = await tools.call("get_current_time", {"timezone": "UTC"}, timeout=30)
            assert not now.is_error

    asyncio.run(main())


@pytest.mark.parametrize("entry, match", [
    ({"command": "/nonexistent/mcp-server"}, "FileNotFoundError"),
    ({"command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]},
     "connection closed"),
    ({"url": "http://127.0.0.1:1/mcp"}, "Connect"),
])
def test_a_server_that_does_not_start_is_named(entry, match):
    async def main():
        tools = McpTools(parse_mcp_config({"mcpServers": {"good": OURS, "broken": entry}}))
        with pytest.raises(RuntimeError, match=match) as info:
            await tools.start()
        assert "MCP server 'broken' did not start" in str(info.value)
        assert "'good'" not in str(info.value)
        assert tools.tools == []

    asyncio.run(main())


def test_a_server_that_never_answers_times_out_at_start():
    silent = {"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"]}

    async def main():
        tools = McpTools(parse_mcp_config({"mcpServers": {"silent": silent}}),
                         start_timeout=1.0)
        with pytest.raises(RuntimeError, match="'silent' did not start: .*within 1 s"):
            await tools.start()

    asyncio.run(main())


def test_openai_names_are_unique_and_allowed():
    tool = lambda name: mcp_types.Tool(name=name, input_schema={"type": "object"})
    listed = [("a", tool("read file")), ("b", tool("read file")), ("a", tool("x" * 70)),
              ("a", tool("x" * 64 + "y")), ("c", tool("ok.name-1"))]
    names = _openai_names(listed)
    assert names[:2] == ["a__read_file", "b__read_file"]
    assert names[4] == "ok.name-1"
    assert len(set(names)) == len(names)
    assert all(len(n) <= 64 and n.replace("_", "").replace(".", "").replace("-", "").isalnum()
               for n in names)


# ---- the config file ----------------------------------------------------------------------

def test_config_file_stdio_and_http(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "time": {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"],
                 "env": {"TZ": "UTC"}},
        "remote": {"type": "http", "url": "https://example.com/mcp",
                   "headers": {"Authorization": "Bearer x"}}}}))
    config = load_mcp_config(path)
    assert config.servers == (
        StdioServer("time", "mcp-server-time", ("--local-timezone", "UTC"), {"TZ": "UTC"}),
        HttpServer("remote", "https://example.com/mcp", {"Authorization": "Bearer x"}))


@pytest.mark.parametrize("text, match", [
    ("{not json", "is not JSON"),
    ("[]", "expected an object"),
    ('{"servers": {}}', "unknown key.*'servers'"),
    ('{"mcpServers": []}', "must be an object of servers"),
    ('{"mcpServers": {"x": "mcp-server-time"}}', "server 'x': expected an object"),
    ('{"mcpServers": {"x": {}}}', "needs \"command\" .* or \"url\""),
    ('{"mcpServers": {"x": {"args": ["a"]}}}', "needs \"command\""),
    ('{"mcpServers": {"x": {"command": "a", "url": "http://h/mcp"}}}', "not both"),
    ('{"mcpServers": {"x": {"command": "a", "argv": []}}}', "unknown key.*'argv'"),
    ('{"mcpServers": {"x": {"url": "http://h/mcp", "env": {}}}}', "unknown key.*'env'"),
    ('{"mcpServers": {"x": {"command": ""}}}', "non-empty string"),
    ('{"mcpServers": {"x": {"command": "a", "args": "b c"}}}', "list of strings"),
    ('{"mcpServers": {"x": {"command": "a", "env": {"N": 1}}}}', "\"env\" must be an object"),
    ('{"mcpServers": {"x": {"url": "ftp://h/mcp"}}}', "http:// or https://"),
    ('{"mcpServers": {"x": {"url": "http://h/mcp", "headers": []}}}', "\"headers\""),
    ('{"mcpServers": {"x": {"type": "sse", "url": "http://h/sse"}}}', "unsupported \"type\""),
    ('{"mcpServers": {"x": {"type": "stdio", "url": "http://h/mcp"}}}', "does not fit"),
    ('{"mcpServers": {"my server": {"command": "a"}}}', "server 'my server': a server's name"),
    ('{"mcpServers": {"a__b": {"command": "a"}}}', "without '__'"),
])
def test_config_file_errors(tmp_path, text, match):
    path = tmp_path / "mcp.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load_mcp_config(path)
    assert str(path) in str(info.value)  # every message names the file


def test_config_file_missing(tmp_path):
    with pytest.raises(ValueError, match="cannot read the MCP config"):
        load_mcp_config(tmp_path / "nope.json")


# ---- xlaserve's own /mcp endpoint -------------------------------------------------------

def test_started_and_stopped_by_an_app_lifespan_called_by_its_handlers():
    """The way the server drives it: start and stop in the lifespan's task, calls from
    request handlers' tasks, on uvicorn's event loop."""
    tools = McpTools(parse_mcp_config({"mcpServers": {"ours": OURS}}))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await tools.start()
        yield
        await tools.stop()

    async def call(request):
        body = await request.json()
        result = await tools.call(body["name"], body["arguments"], timeout=body["timeout"])
        return JSONResponse({"text": result.text, "is_error": result.is_error})

    app = Starlette(routes=[Route("/call", call, methods=["POST"])], lifespan=lifespan)
    with live(app) as url:
        def post(name, arguments, timeout=30):
            return httpx.post(f"{url}/call", json={"name": name, "arguments": arguments,
                                                  "timeout": timeout}, timeout=60).json()
        assert post("echo", {"text": "hi"}) == {"text": "hi", "is_error": False}
        hung = post("hang", {}, timeout=0.5)
        assert hung["is_error"] and "timed out after 0.5 s" in hung["text"]
        assert post("echo", {"text": "again"}) == {"text": "again", "is_error": False}
    gone = asyncio.run(tools.call("echo", {"text": "x"}, timeout=5))  # stopped at shutdown
    assert gone.is_error and "down" in gone.text


@contextlib.contextmanager
def serving_mcp(engines: Engines, **app_options):
    """The real app (its middleware, /v1 routes, /mcp with its session manager run by the
    app's lifespan), live: yields the base URL."""
    with live(build_app(engines, **app_options)) as url:
        yield url


@pytest.fixture(scope="module")
def served(tokenizer):
    """(URL, the engine of 'fake', its runners) with a second model, 'org/fake:2'."""
    a, runners = make_engine(tokenizer, name="fake", step=1)
    b, _ = make_engine(tokenizer, name="org/fake:2", step=2)
    engines = Engines({"fake": a, "org/fake:2": b})
    with serving_mcp(engines, api_key=KEY) as url:
        yield url, a, runners
    for r in runners:
        r.unpause()
    engines.shutdown()


@pytest.fixture
def mcp_url(served):
    return served[0]


@contextlib.asynccontextmanager
async def mcp_client(url: str, key: str = KEY):
    """The SDK's client on /mcp (streamable HTTP), sending the key."""
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
        async with Client(streamable_http_client(f"{url}/mcp", http_client=http)) as client:
            yield client


def test_endpoint_lists_a_tool_per_model(mcp_url):
    async def main():
        async with mcp_client(mcp_url) as client:
            listed = (await client.list_tools()).tools
        return {t.name: t for t in listed}

    tools = asyncio.run(main())
    assert set(tools) == {"fake", "org_fake_2"}
    schema = tools["fake"].input_schema
    assert schema["required"] == ["prompt"]
    assert set(schema["properties"]) == {"prompt", "system", "max_tokens", "temperature"}
    assert "'org/fake:2'" in tools["org_fake_2"].description


@pytest.mark.parametrize("tool, model", [("fake", "fake"), ("org_fake_2", "org/fake:2")])
def test_endpoint_call_returns_the_models_reply(mcp_url, tool, model):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hello"}]
    chat = httpx.post(f"{mcp_url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": model, "messages": messages, "max_tokens": 5,
                            "temperature": 0})
    assert chat.status_code == 200, chat.text
    expected = chat.json()["choices"][0]["message"]["content"]
    assert expected

    async def main():
        async with mcp_client(mcp_url) as client:
            return await client.call_tool(tool, {"prompt": "Say hello", "system": "Be brief.",
                                                 "max_tokens": 5, "temperature": 0})

    result = asyncio.run(main())
    assert not result.is_error, result
    assert [c.text for c in result.content] == [expected]


def test_endpoint_bad_arguments_are_tool_errors(mcp_url):
    bad = [{}, {"prompt": ""}, {"prompt": 3}, {"prompt": "hi", "max_tokens": "many"},
           {"prompt": "hi", "max_tokens": 0}, {"prompt": "hi", "temperature": -1},
           {"prompt": "hi", "temperature": "hot"}, {"prompt": "hi", "top_p": 0.5},
           {"prompt": "hi", "system": ["x"]}, {"prompt": "hi", "max_tokens": 10**6}]

    async def main():
        async with mcp_client(mcp_url) as client:
            results = [await client.call_tool("fake", args) for args in bad]
            with pytest.raises(MCPError, match="Unknown tool"):
                await client.call_tool("no_such_model", {"prompt": "hi"})
            ok = await client.call_tool("fake", {"prompt": "hi", "max_tokens": 2})
        return results, ok

    results, ok = asyncio.run(main())
    for args, result in zip(bad, results, strict=True):
        assert result.is_error, (args, result)
        assert result.content[0].text, args
    texts = [r.content[0].text for r in results]
    assert "prompt" in texts[0] and "max_tokens" in texts[3] and "top_p" in texts[7]
    assert "temperature" in texts[5]
    assert "context" in texts[9]  # the engine's own refusal
    assert not ok.is_error  # and the server still answers


def test_endpoint_needs_the_api_key_and_a_post(mcp_url):
    init = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream"}
    for auth in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{mcp_url}/mcp", json=init, headers=headers | auth, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"

    get = httpx.get(f"{mcp_url}/mcp", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert get.status_code == 405  # no event stream to open: stateless

    async def main():
        async with mcp_client(mcp_url, key="wrong") as client:
            await client.list_tools()

    with pytest.raises(Exception):  # noqa: B017 (the SDK's client drops the status: MCPError)
        asyncio.run(main())


def test_mcp_tools_over_streamable_http_reach_the_endpoint(mcp_url):
    """McpTools' HTTP path, against our own /mcp: headers sent, tools listed, a call made,
    and a refused key named at start with the HTTP status the SDK's error leaves out."""
    auth = {"Authorization": f"Bearer {KEY}"}

    async def main():
        async with started({"self": {"url": f"{mcp_url}/mcp", "headers": auth}}) as tools:
            assert {t["function"]["name"] for t in tools.tools} == {"fake", "org_fake_2"}
            reply = await tools.call("fake", {"prompt": "hi", "max_tokens": 3}, timeout=60)
            assert not reply.is_error and reply.text
            bad = await tools.call("fake", {"prompt": ""}, timeout=60)
            assert bad.is_error and "prompt" in bad.text
        wrong = McpTools(parse_mcp_config({"mcpServers": {"self": {
            "url": f"{mcp_url}/mcp", "headers": {"Authorization": "Bearer wrong"}}}}))
        with pytest.raises(RuntimeError, match="'self' did not start: .*HTTP 401"):
            await wrong.start()

    asyncio.run(main())


def test_tool_names_of_models():
    assert tool_names(["SmolLM2-135M-Instruct", "org/m:q4", "org_m_q4", "x" * 80]) == {
        "SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct", "org_m_q4": "org/m:q4",
        "org_m_q4_2": "org_m_q4", "x" * 64: "x" * 80}


@pytest.mark.parametrize("version", ["2025-06-18", "2026-07-28"])
def test_endpoint_call_whose_client_leaves_aborts_the_engine_request(served, version):
    url, engine, runners = served
    runner = runners[0]
    runner.paused.clear()
    runner.unpaused, runner.pause_after = False, runner.calls + 2
    body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "fake", "arguments": {"prompt": "hi", "max_tokens": 80}}}
    headers = {"Authorization": f"Bearer {KEY}", "MCP-Protocol-Version": version,
               "Accept": "application/json, text/event-stream"}
    if version == "2026-07-28":  # the modern era: each request carries its envelope
        body["params"]["_meta"] = {"io.modelcontextprotocol/protocolVersion": version,
                                   "io.modelcontextprotocol/clientCapabilities": {},
                                   "io.modelcontextprotocol/clientInfo": {"name": "t",
                                                                          "version": "1"}}
        headers |= {"Mcp-Method": "tools/call", "Mcp-Name": "fake"}

    def post():
        with contextlib.suppress(httpx.ReadTimeout):  # the client gives up and leaves
            httpx.post(f"{url}/mcp", json=body, headers=headers, timeout=2)

    thread = threading.Thread(target=post)
    thread.start()
    try:
        assert wait_until(runner.paused.is_set, timeout=30)  # generating, and held there
        assert len(engine._streams) == 1
        thread.join(30)
        # The runner is still held, so only an abort can end the request's stream.
        assert wait_until(lambda: not engine._streams, timeout=30)
    finally:
        runner.unpause()
        thread.join(30)
    assert wait_until(lambda: not engine.engine.has_unfinished(), timeout=30)
