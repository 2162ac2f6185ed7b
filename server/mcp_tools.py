"""The MCP servers whose tools xlaserve runs itself (`--mcp-config FILE`), through the
official `mcp` SDK: one client session per server of the config file (server/mcp_config.py),
the servers' tools as OpenAI function tools, and calls that always come back as a result the
model can read.

Each session lives in a task of its own, which enters the SDK's clients (async context
managers holding anyio task groups and cancel scopes) and leaves them again; `start`,
`stop` and `call` may come from any task on the same event loop (the app's lifespan,
request handlers), and a session that fails later ends its own task, not its caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
from collections import Counter

import httpx2
import mcp_types
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from server.mcp_config import SERVER_PREFIX_SEP, McpConfig, McpServer, StdioServer

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0  # to spawn or reach a server, initialize it and list its tools
# A call's timeout runs from when its request is written; a write that blocks (a stdio
# server that stopped reading its stdin) is bounded by this much more.
WRITE_GRACE_S = 5.0
# The SDK's own HTTP timeouts: a streamed answer may be quiet for minutes.
HTTP_TIMEOUT = httpx2.Timeout(30.0, read=300.0)


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a tool call gave, as the text the model reads; `is_error` when the tool reported
    a failure or could not be run (the text says why)."""

    text: str
    is_error: bool = False


def result_text(result: mcp_types.CallToolResult) -> str:
    """A tool result's content parts as one text: text as it is, other parts named."""
    parts = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
            parts.append(f"[{block.type}: {block.mime_type}]")
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource: {block.uri}]")
        elif isinstance(block, mcp_types.EmbeddedResource):
            res = block.resource
            parts.append(res.text if isinstance(res, mcp_types.TextResourceContents)
                         else f"[resource: {res.uri} ({res.mime_type or 'binary'})]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


@dataclasses.dataclass(frozen=True)
class _Tool:
    server: str
    name: str  # the server's own name for it
    definition: dict  # the OpenAI function tool


class _Session:
    """One server's client session, entered and left by its own task (`_run`)."""

    def __init__(self, server: McpServer):
        self.server = server
        self.client: Client | None = None
        self.tools: list[mcp_types.Tool] = []
        self.gone: str | None = None  # why the session ended, once it has
        # The last HTTP error status: the SDK's errors leave it out ("Server returned an
        # error response" for a 401).
        self.http_error: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def open(self, timeout: float) -> None:
        """Start the session's task and wait until it is ready; RuntimeError says why not."""
        ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(ready), name=f"mcp-{self.server.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout)
        except BaseException as e:
            ready.cancel()  # (what the task learns later is no one's to hear)
            await self.close()
            if isinstance(e, TimeoutError):
                raise RuntimeError(f"no answer within {timeout:g} s") from None
            raise

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None and not self._task.done():
            if self.client is None:  # still connecting: nothing to wind down politely
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self, ready: asyncio.Future) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                client = await stack.enter_async_context(Client(self._transport(stack)))
                self.tools = await _list_tools(client)
                self.client = client
                if not ready.done():  # (not given up on by `open`)
                    ready.set_result(None)
                await self._stop.wait()
                self.client = None  # calls from now on hear that it is down
            self.gone = "it was stopped"
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # its own task: report, never propagate further
            self.gone = _describe(e) + (f" ({self.http_error})" if self.http_error else "")
            if not ready.done():
                ready.set_exception(RuntimeError(self.gone))
            elif not self._stop.is_set():
                logger.error("MCP server %r: its session ended: %s", self.server.name,
                             self.gone)
        finally:
            self.client = None

    def _transport(self, stack: contextlib.AsyncExitStack):
        s = self.server
        if isinstance(s, StdioServer):
            return StdioServerParameters(command=s.command, args=list(s.args), env=s.env,
                                         cwd=s.cwd)
        # (the SDK's transport takes an httpx2 client for headers, and leaves closing it to us)
        http = httpx2.AsyncClient(headers=s.headers, timeout=HTTP_TIMEOUT,
                                  event_hooks={"response": [self._note_http_error]})
        stack.push_async_callback(http.aclose)
        return streamable_http_client(s.url, http_client=http)

    async def _note_http_error(self, response: httpx2.Response) -> None:
        if response.status_code >= 400:
            self.http_error = f"HTTP {response.status_code} from {response.request.url}"


async def _list_tools(client: Client) -> list[mcp_types.Tool]:
    if client.server_capabilities.tools is None:
        return []
    tools, cursor = [], None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if cursor is None:
            return tools


def _describe(e: BaseException) -> str:
    if isinstance(e, MCPError):
        return e.message if e.code != mcp_types.CONNECTION_CLOSED else "the connection closed"
    if isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        return _describe(e.exceptions[0])
    if isinstance(e, asyncio.CancelledError):
        return "it was cancelled"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _openai_names(listed: list[tuple[str, mcp_types.Tool]]) -> list[str]:
    """A unique OpenAI function name for each (server, tool): the tool's own name, or
    SERVER__name where another server offers the same one; characters outside the allowed
    set become '_', and a name that still collides gets a number."""
    counts = Counter(tool.name for _, tool in listed)
    names, taken = [], set()
    for server, tool in listed:
        name = tool.name if counts[tool.name] == 1 else f"{server}{SERVER_PREFIX_SEP}{tool.name}"
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64] or "tool"
        base, n = name, 1
        while name in taken:
            n += 1
            name = f"{base[:64 - len(str(n)) - 1]}_{n}"
        taken.add(name)
        names.append(name)
    return names


class McpTools:
    """The tools of the configured MCP servers.

        tools = McpTools(load_mcp_config(path))
        await tools.start()         # in the app's lifespan: every server, or an error
        tools.tools                 # OpenAI function tools
        await tools.call("get_current_time", {"timezone": "UTC"}, timeout=30.0)
        await tools.stop()          # in the lifespan, on the same event loop
    """

    def __init__(self, config: McpConfig, start_timeout: float = START_TIMEOUT_S):
        self.config = config
        self.start_timeout = start_timeout
        self._sessions: dict[str, _Session] = {}
        self._tools: dict[str, _Tool] = {}

    async def start(self) -> None:
        """Connect to every server, initialize it and list its tools, all at once. A server
        that fails stops the others and raises a RuntimeError naming it."""
        if self._sessions:
            raise RuntimeError("the MCP servers are started already")
        sessions = {s.name: _Session(s) for s in self.config.servers}
        try:
            results = await asyncio.gather(
                *(s.open(self.start_timeout) for s in sessions.values()), return_exceptions=True)
        except BaseException:  # start itself cancelled: leave nothing running
            await asyncio.gather(*(s.close() for s in sessions.values()))
            raise
        failed = [(name, e if isinstance(e, RuntimeError) else _describe(e))
                  for name, e in zip(sessions, results, strict=True)
                  if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(s.close() for s in sessions.values()))
            raise RuntimeError("; ".join(f"MCP server {name!r} did not start: {why}"
                                         for name, why in failed))
        self._sessions = sessions
        listed = [(name, tool) for name, s in sessions.items() for tool in s.tools]
        self._tools = {
            name: _Tool(server, tool.name, {"type": "function", "function": {
                "name": name, "description": tool.description or tool.title or "",
                "parameters": tool.input_schema}})
            for name, (server, tool) in zip(_openai_names(listed), listed, strict=True)}
        for name, s in sessions.items():
            logger.info("MCP server %r: %d tools (%s)", name, len(s.tools),
                        ", ".join(t.name for t in s.tools))

    async def stop(self) -> None:
        """Close every session (a stdio server's process is ended)."""
        sessions, self._sessions = self._sessions, {}
        await asyncio.gather(*(s.close() for s in sessions.values()))

    @property
    def tools(self) -> list[dict]:
        """Every server's tools as OpenAI function tools, each name unique."""
        return [json.loads(json.dumps(t.definition)) for t in self._tools.values()]

    def server_of(self, name: str) -> str | None:
        """The name of the server offering a tool (by its OpenAI name)."""
        tool = self._tools.get(name)
        return tool.server if tool else None

    async def call(self, name: str, arguments: dict, timeout: float) -> ToolResult:
        """Run a tool (by its OpenAI name). Never raises for the tool's failure: a failure,
        an unknown tool, a dead server or a timeout is a result with `is_error` set and the
        reason as its text. Cancelling the awaiting task cancels the call (the server is
        told) and leaves the session usable."""
        tool = self._tools.get(name)
        if tool is None:
            return ToolResult(f"unknown tool {name!r}; the tools are: "
                              f"{', '.join(self._tools) or 'none'}", True)
        if not isinstance(arguments, dict):
            return ToolResult(f"tool {name!r}: its arguments must be a JSON object, got "
                              f"{type(arguments).__name__}", True)
        session = self._sessions.get(tool.server)
        client = session.client if session else None
        if client is None:
            why = session.gone if session and session.gone else "it is not running"
            return ToolResult(f"tool {name!r} cannot run: MCP server {tool.server!r} is "
                              f"down ({why})", True)
        try:
            async with asyncio.timeout(timeout + WRITE_GRACE_S):
                result = await client.call_tool(tool.name, arguments,
                                                read_timeout_seconds=timeout)
        except TimeoutError:
            return self._timed_out(name, timeout)
        except MCPError as e:
            if e.code == mcp_types.REQUEST_TIMEOUT:
                return self._timed_out(name, timeout)
            if e.code == mcp_types.CONNECTION_CLOSED:
                return ToolResult(f"tool {name!r} failed: the connection to MCP server "
                                  f"{tool.server!r} closed", True)
            return ToolResult(f"tool {name!r} failed: {e.message}", True)
        except Exception as e:  # a malformed result, a transport error
            logger.warning("MCP tool %r (server %r): %s", name, tool.server, _describe(e))
            return ToolResult(f"tool {name!r} failed: {_describe(e)}", True)
        return ToolResult(result_text(result), bool(result.is_error))

    @staticmethod
    def _timed_out(name: str, timeout: float) -> ToolResult:
        return ToolResult(f"tool {name!r} timed out after {timeout:g} s", True)
