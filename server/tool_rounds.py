"""The server-side tool loop (engine/tool_loop.py) on chat completions: the server's tools
are offered beside the request's own, and while a reply calls only the server's tools they
run and the chat goes on, inside the one request. A reply that calls a tool of the client's
goes back to the client (calls to the server's tools in it are not run); a chat that
reaches the round cap ends with finish_reason "length". Streamed, each round's text is sent
as it comes and only the client's calls appear as tool_calls. Usage counts every round.

Server tools are offered to requests of one choice (`n` 1) whose tool_choice is not "none":
added to the body's tools before it is validated (`offered`), so a tool_choice may name them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine
from engine.tool_loop import ToolCall, ToolLoop, ToolResult, after_calls
from server.chat import ChatGeneration, start_chat
from server.chat_protocol import ChatCompletionRequest, ChatMessage
from server.errors import APIError, api_error
from server.generation import ClosingStream, disconnected, sse
from server.metrics import RequestTracker
from server.reasoning import ReasoningParser


def offered(body, loop: ToolLoop | None, nested: bool = True):
    """A request body (parsed JSON, not validated yet) with the server's tools added to its
    own, when they apply to it; `nested`: chat's tool shape ({"function": {...}}), else the
    Responses API's (flat). Anything malformed is left for validation to refuse."""
    if loop is None or not isinstance(body, dict) or body.get("tool_choice") == "none" \
            or body.get("n", 1) != 1 or not loop.definitions:
        return body
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        return body
    own = {(t.get("function") if nested else t).get("name") for t in tools
           if isinstance(t, dict) and isinstance(t.get("function") if nested else t, dict)}
    clash = own & loop.names()
    if clash:
        raise APIError(400, f"tools: {', '.join(sorted(map(str, clash)))} is a tool this "
                            f"server runs itself; rename the request's tool", param="tools")
    mine = [d if nested else {"type": "function", **d["function"]} for d in loop.definitions]
    return {**body, "tools": [*tools, *mine]}


def continued(req: ChatCompletionRequest, content: str | None, calls: list[ToolCall],
              results: list[ToolResult]) -> ChatCompletionRequest:
    messages = after_calls([m.model_dump(exclude_none=True) for m in req.messages], content,
                           calls, results)
    return req.model_copy(update={"messages": [ChatMessage.model_validate(m)
                                               for m in messages]})


def calls_of(message: dict) -> list[ToolCall]:
    return [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", ())]


def streamed_calls(gen: ChatGeneration) -> list[ToolCall]:
    """A streamed round's calls, as its tool stream parsed them."""
    stream = gen._tool_streams.get(0)
    return [ToolCall(k.id, k.name, k.arguments) for k in stream.calls] if stream else []


def to_run(loop: ToolLoop | None, calls: list[ToolCall],
           round_: int) -> tuple[list[ToolCall], bool]:
    """The server's calls to run before another round, [] when this round is the last (no
    call of the server's, a call of the client's, or the cap); and whether the cap ended it."""
    mine = loop.server_calls(calls) if loop is not None else []
    if not mine or len(mine) < len(calls):
        return [], False
    if round_ == loop.max_rounds:
        return [], True
    return mine, False


async def run_unless_gone(request: Request, loop: ToolLoop,
                          calls: list[ToolCall]) -> list[ToolResult] | None:
    """The calls' results; None (the calls cancelled) when the client leaves first."""
    run = asyncio.create_task(loop.run(calls))
    gone = asyncio.create_task(disconnected(request))
    try:
        await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not run.done():
            run.cancel()
    return run.result() if run.done() and not run.cancelled() else None


class Usage:
    def __init__(self):
        self.prompt = self.completion = self.cached = 0

    def add(self, usage: dict) -> None:
        self.prompt += usage["prompt_tokens"]
        self.completion += usage["completion_tokens"]
        self.cached += usage["prompt_tokens_details"]["cached_tokens"]

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached}}


async def chat_with_tools(request: Request, req: ChatCompletionRequest, model: str,
                          engine: AsyncEngine, tracker: RequestTracker, loop: ToolLoop,
                          reasoning: ReasoningParser | None = None,
                          allow_special_tokens_in_messages: bool = False) -> Response:
    rounds = _Rounds(request, req, model, engine, tracker, loop, reasoning,
                     allow_special_tokens_in_messages)
    if req.stream:
        gen = await rounds.start()
        return ClosingStream(rounds.events(gen), rounds.close, media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await rounds.whole()


class _Rounds:
    """One chat request's rounds, whole or streamed."""

    def __init__(self, request, req, model, engine, tracker, loop, reasoning, allow):
        self.request, self.req, self.loop = request, req, loop
        self.args = (model, engine, tracker, reasoning, allow)
        self.usage = Usage()
        self.current: ChatGeneration | None = None
        self.id: str | None = None

    async def start(self) -> ChatGeneration:
        gen = await start_chat(self.req, *self.args)
        self.id = self.id or gen.id
        gen.id = self.id  # every round's chunks are one completion's
        self.current = gen
        return gen

    def close(self) -> None:
        if self.current is not None:
            self.current.close()

    async def whole(self) -> Response:
        for round_ in range(self.loop.max_rounds + 1):
            gen = await self.start()
            if not await gen.finish(self.request):
                return Response(status_code=499)
            body = gen.body()
            self.usage.add(body["usage"])
            body["usage"] = self.usage.body()
            choice = body["choices"][0]
            message = choice["message"]
            mine, _ = to_run(self.loop, calls_of(message), round_)
            if not mine:
                calls = message.get("tool_calls", [])
                theirs = [c for c in calls if c["function"]["name"] not in self.loop.names()]
                if len(theirs) < len(calls):  # the server's calls are not run: not shown
                    message.pop("tool_calls")
                    if theirs:
                        message["tool_calls"] = theirs
                    choice["finish_reason"] = "tool_calls" if theirs else "length"
                return JSONResponse(body)
            results = await run_unless_gone(self.request, self.loop, mine)
            if results is None:
                return Response(status_code=499)
            self.req = continued(self.req, message.get("content"), mine, results)
        raise AssertionError("unreachable")

    async def events(self, gen: ChatGeneration) -> AsyncIterator[str]:
        mine = self.loop.names()
        shown = 0  # the client's calls sent so far (their indexes in the stream)
        try:
            for event in gen._opening():
                yield event
            for round_ in range(self.loop.max_rounds + 1):
                if round_:
                    gen = await self.start()
                index_of: dict[int, int | None] = {}  # a call in this reply -> its stream index
                finish = None
                async for _, out in gen.outputs():
                    c = out.outputs[0]
                    delta = gen._delta(0, c)
                    if delta is None:
                        continue
                    content, finish = delta
                    theirs = []
                    for d in content.pop("tool_calls", ()):
                        if d["index"] not in index_of:
                            server = d["function"].get("name") in mine
                            index_of[d["index"]] = None if server else shown
                            shown += 0 if server else 1
                        if index_of[d["index"]] is not None:
                            theirs.append({**d, "index": index_of[d["index"]]})
                    if theirs:
                        content["tool_calls"] = theirs
                    lps = gen._logprobs(c.logprobs) if c.logprobs else None
                    if content or lps:
                        yield gen._chunk(0, content, lps, None, c.token_ids)
                self.usage.add(gen.usage())
                calls = streamed_calls(gen)
                server_calls, capped = to_run(self.loop, calls, round_)
                if not server_calls:
                    if capped:
                        finish = "length"  # the cap: the last round's calls are not run
                    elif self.loop.server_calls(calls):
                        finish = "tool_calls"  # the client's calls beside them
                    yield gen._chunk(0, {}, None, finish)
                    break
                results = await self.loop.run(server_calls)  # (a client gone cancels this)
                self.req = continued(self.req, reply_content(gen), server_calls, results)
            if gen.include_usage:
                yield sse({"id": self.id, "object": gen.CHUNK_OBJECT, "created": gen.created,
                            "model": gen.model, "choices": [], "usage": self.usage.body()})
        except Exception as e:  # mid-stream failure: an error event, then [DONE]
            yield sse(api_error(e).body())
        yield "data: [DONE]\n\n"


def reply_content(gen: ChatGeneration) -> str | None:
    """A finished round's reply text without its calls (and reasoning), as the template
    gets it back."""
    message = gen._choice(0, 0, gen.last[0].outputs[0])["message"]
    return message.get("content")
