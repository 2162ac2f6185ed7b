"""The server-side tool loop: tools the server runs itself (declared at startup, e.g. the
tools of MCP servers) called by the model inside one request. A round is one generation;
when its reply calls the server's tools, they run (concurrently, each within a timeout, a
failure or a timeout handed to the model as the call's result), the reply and the results
are appended to the conversation as chat messages, and the next round generates from there,
until a reply calls none of them or the round cap is hit.

The wire formats drive the rounds (server/tool_rounds.py: chat completions and responses,
whole or streamed); this module owns what a round means: which calls are the server's,
running them, and the conversation after them. Pure Python and asyncio; the tool runner is
anything with `names()` and `call()` (server/mcp_tools.McpTools).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Protocol

DEFAULT_MAX_ROUNDS = 8
DEFAULT_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclasses.dataclass(frozen=True)
class ToolResult:
    text: str
    is_error: bool = False


class ToolRunner(Protocol):
    @property
    def tools(self) -> list[dict]:
        """The tools as OpenAI function tools (known once the runner has started)."""

    async def call(self, name: str, arguments: dict, timeout: float) -> ToolResult:
        """A call's result; a failure is a result with `is_error`, never an exception."""


class ToolLoop:
    """The server's tools and the loop's limits: at most `max_rounds` rounds of calls a
    request, `timeout` seconds a call."""

    def __init__(self, runner: ToolRunner, max_rounds: int = DEFAULT_MAX_ROUNDS,
                 timeout: float = DEFAULT_TIMEOUT_S):
        if max_rounds < 1 or not timeout > 0:
            raise ValueError("the tool loop needs max_rounds >= 1 and a timeout > 0")
        self.runner = runner
        self.max_rounds = max_rounds
        self.timeout = timeout

    @property
    def definitions(self) -> list[dict]:
        """The server's tools as offered to the model (OpenAI function tools). An object of
        arguments that does not say whether it takes other properties takes none (as OpenAI's
        strict mode has it): a grammar-constrained call then ends with the arguments the tool
        names, instead of inventing more until the token limit."""
        tools = self.runner.tools
        for tool in tools:
            schema = tool["function"].get("parameters")
            if isinstance(schema, dict) and schema.get("type") == "object":
                schema.setdefault("additionalProperties", False)
        return tools

    def names(self) -> set[str]:
        return {d["function"]["name"] for d in self.definitions}

    def server_calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls the server runs: those of its own tools."""
        names = self.names()
        return [c for c in calls if c.name in names]

    async def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Every call's result, in order, run at once. Arguments that are not a JSON object
        are the model's mistake and its result says so."""
        return list(await asyncio.gather(*(self._one(c) for c in calls)))

    async def _one(self, call: ToolCall) -> ToolResult:
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError as e:
            return ToolResult(f"the arguments of {call.name!r} are not JSON: {e}", True)
        if not isinstance(arguments, dict):
            return ToolResult(f"the arguments of {call.name!r} must be a JSON object", True)
        return await self.runner.call(call.name, arguments, self.timeout)


def after_calls(messages: list[dict], content: str | None, calls: list[ToolCall],
                results: list[ToolResult]) -> list[dict]:
    """The conversation after a round: the assistant's turn with its calls, then each call's
    result as a tool message (an error's text marked as one)."""
    turn = {"role": "assistant", "content": content or None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls]}
    answers = [{"role": "tool", "tool_call_id": c.id,
                "content": f"Error: {r.text}" if r.is_error else r.text}
               for c, r in zip(calls, results, strict=True)]
    return [*messages, turn, *answers]
