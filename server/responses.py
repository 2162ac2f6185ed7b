"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API, run as a
chat (server/chat.py) whose reply is shaped as output items (reasoning, a message, function
calls), whole or as the Responses event stream (`response.created` ... `response.completed`,
each item's added/delta/done events; ids and texts equal to the final object's).

With the server's own tools (`--mcp-config`, engine/tool_loop.py) a response runs in rounds:
a reply that calls only those tools has them run, each call an `mcp_call` item with its
output or error, and the next round goes on (server/tool_rounds.py); the round cap ends it
`incomplete` ("max_tool_calls").

A response with `store` (the default) is kept in the session store (engine/sessions.py) with
the conversation it ended; `previous_response_id` continues that conversation: it is
rendered again with the new input, and the prefix cache serves the earlier turns' tokens.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine
from engine.sessions import SessionStore, StoredResponse
from engine.tool_loop import ToolCall, ToolLoop
from server.chat import ChatGeneration, start_chat
from server.errors import CLIENT_ERRORS, APIError, api_error
from server.generation import ClosingStream
from server.metrics import RequestTracker
from server.reasoning import ReasoningParser
from server.response_items import StreamedItems, items_of, mcp_item, new_id
from server.responses_protocol import ResponsesRequest, chat_param
from server.tool_rounds import (
    Usage,
    calls_of,
    continued,
    reply_content,
    run_unless_gone,
    streamed_calls,
    to_run,
)


class ResponseRun:
    """One Responses request across its rounds (one without the server's tools has one): each
    round a chat generation, their replies shaped as output items."""

    def __init__(self, request: Request, req: ResponsesRequest, model: str,
                 engine: AsyncEngine, tracker: RequestTracker, store: SessionStore,
                 history: list[dict], reasoning: ReasoningParser | None, allow: bool,
                 loop: ToolLoop | None):
        self.request, self.req, self.store, self.loop = request, req, store, loop
        self.args = (model, engine, tracker, reasoning, allow)
        self.model = model
        self.id = new_id("resp")
        self.created = int(time.time())
        self.chat = req.chat_request(history)
        self.server_tools = loop.names() if loop is not None else set()
        self.usage = Usage()
        self.current: ChatGeneration | None = None
        self.capped = False  # the round cap ended it
        self.kept = False  # stored: the store releases its blocks when it drops it

    async def start_round(self) -> ChatGeneration:
        # A stored response's turn keeps its blocks cached while the store keeps it.
        self.current = await start_chat(self.chat, *self.args,
                                        session=self.id if self.req.store else None)
        return self.current

    def close(self) -> None:
        """The run is over, however it ended: a response that was to be stored and was not
        (an error, a client gone after a round of tool calls) releases the blocks its rounds
        kept."""
        if self.current is not None:
            self.current.close()
        if self.req.store and not self.kept and self.store.on_drop is not None:
            self.store.on_drop(self.id)

    def _server(self, name: str) -> str:
        server_of = getattr(self.loop.runner, "server_of", None)
        return (server_of(name) if server_of else None) or "xlaserve"

    def _continues(self, calls: list[ToolCall], round_: int) -> list[ToolCall]:
        """The server's calls to run before another round ([] for the last round)."""
        mine, capped = to_run(self.loop, calls, round_)
        self.capped = self.capped or capped
        return mine

    # ---- the response object ------------------------------------------------------------

    def _object(self, status: str, output: list[dict], finish: str | None = None,
                error: dict | None = None) -> dict:
        usage = None
        if status != "in_progress":
            chat = self.usage.body()
            usage = {"input_tokens": chat["prompt_tokens"],
                     "input_tokens_details": chat["prompt_tokens_details"],
                     "output_tokens": chat["completion_tokens"],
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": chat["total_tokens"]}
        reason = ("max_tool_calls" if self.capped else
                  "max_output_tokens" if finish == "length" else None)
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": "incomplete" if reason and status == "completed" else status,
                "model": self.model, "output": output, "error": error,
                "incomplete_details": {"reason": reason} if reason else None,
                "usage": usage, **self.req.echo()}

    def _keep(self, response: dict, output: list[dict]) -> None:
        """Stores the response with its conversation (when the request asked to): the chat
        of its last round, without the instructions, and the last reply."""
        if not self.req.store:
            return
        last = []
        for item in reversed(output):  # the last round's items (after any server call)
            if item["type"] == "mcp_call":
                break
            last.insert(0, item)
        reply: dict = {"role": "assistant", "content": None}
        text = "".join(part["text"] for item in last if item["type"] == "message"
                       for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in last if item["type"] == "function_call"]
        if text or not calls:
            reply["content"] = text
        if calls:
            reply["tool_calls"] = calls
        messages = [m.model_dump(exclude_none=True) for m in self.chat.messages]
        if self.req.instructions:
            messages = messages[1:]
        self.kept = self.store.put(self.id, StoredResponse(response, messages + [reply]))

    # ---- whole --------------------------------------------------------------------------

    async def whole(self, gen: ChatGeneration) -> Response:
        try:
            return await self._whole(gen)
        finally:
            self.close()

    async def _whole(self, gen: ChatGeneration) -> Response:
        output: list[dict] = []
        for round_ in itertools.count():
            if round_:
                gen = await self.start_round()
            if not await gen.finish(self.request):
                return Response(status_code=499)
            self.usage.add(gen.usage())
            out = gen.last[0].outputs[0]
            message = gen._choice(0, 0, out)["message"]
            output += items_of(message, self.server_tools)
            mine = self._continues(calls_of(message), round_)
            if not mine:
                response = self._object("completed", output, out.finish_reason)
                self._keep(response, output)
                return JSONResponse(response)
            results = await run_unless_gone(self.request, self.loop, mine)
            if results is None:
                return Response(status_code=499)
            output += [mcp_item(new_id("mcp"), c, self._server(c.name), r)
                       for c, r in zip(mine, results, strict=True)]
            self.chat = continued(self.chat, message.get("content"), mine, results)
        raise AssertionError("unreachable")

    # ---- the event stream ---------------------------------------------------------------

    async def events(self, gen: ChatGeneration) -> AsyncIterator[str]:
        numbers = itertools.count()

        def event(kind: str, **fields) -> str:
            data = {"type": kind, "sequence_number": next(numbers), **fields}
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        items = StreamedItems(event)
        yield event("response.created", response=self._object("in_progress", []))
        yield event("response.in_progress", response=self._object("in_progress", []))
        try:
            for round_ in itertools.count():
                if round_:
                    gen = await self.start_round()
                items.new_round(self.server_tools)
                finish = None
                async for _, out in gen.outputs():
                    c = out.outputs[0]
                    delta = gen._delta(0, c)
                    if delta is None:
                        continue
                    for text in items.feed(delta[0]):
                        yield text
                    finish = c.finish_reason or finish
                self.usage.add(gen.usage())
                mine = self._continues(streamed_calls(gen), round_)
                if not mine:
                    break
                for text in items.close_text():
                    yield text
                pending = []
                for c in mine:
                    index, added = items.add(mcp_item(new_id("mcp"), c, self._server(c.name), None))
                    pending.append(index)
                    yield added
                for index, call in zip(pending, mine, strict=True):
                    item_id = items.output[index]["id"]
                    yield event("response.mcp_call_arguments.delta", item_id=item_id,
                                output_index=index, delta=call.arguments)
                    yield event("response.mcp_call_arguments.done", item_id=item_id,
                                output_index=index, arguments=call.arguments)
                    yield event("response.mcp_call.in_progress", item_id=item_id,
                                output_index=index)
                results = await self.loop.run(mine)  # (a client gone cancels this)
                for index, call, result in zip(pending, mine, results, strict=True):
                    item = items.output[index]
                    item.update(mcp_item(item["id"], call, item["server_label"], result))
                    yield event(f"response.mcp_call.{item['status']}", item_id=item["id"],
                                output_index=index)
                    yield event("response.output_item.done", output_index=index, item=item)
                self.chat = continued(self.chat, reply_content(gen), mine, results)
            for text in items.close_all():
                yield text
            response = self._object("completed", items.output, finish)
            self._keep(response, items.output)
            yield event(f"response.{response['status']}", response=response)
        except Exception as e:  # mid-stream failure: the response failed, with its error
            err = api_error(e)
            for text in items.close_all():
                yield text
            yield event("response.failed", response=self._object(
                "failed", items.output, error={"code": err.code or "server_error",
                                               "message": err.message}))


async def create_response(request: Request, req: ResponsesRequest, model: str,
                          engine: AsyncEngine, tracker: RequestTracker, store: SessionStore,
                          reasoning: ReasoningParser | None = None,
                          allow_special_tokens_in_messages: bool = False,
                          loop: ToolLoop | None = None) -> Response:
    history: list[dict] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise APIError(404, f"no stored response with id {req.previous_response_id!r} (it "
                                f"was not stored, was deleted or has expired)",
                           param="previous_response_id", code="response_not_found")
        history = previous.messages
    try:
        run = ResponseRun(request, req, model, engine, tracker, store, history, reasoning,
                          allow_special_tokens_in_messages, loop)
        gen = await run.start_round()
    except CLIENT_ERRORS as e:  # said of the chat request: point at the Responses field
        err = api_error(e)
        raise APIError(err.status, err.message, param=chat_param(err.param), code=err.code,
                       headers=err.headers) from None
    if not req.stream:
        return await run.whole(gen)
    return ClosingStream(run.events(gen), run.close, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def get_response(store: SessionStore, response_id: str) -> Response:
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.response)


def delete_response(store: SessionStore, response_id: str) -> Response:
    if not store.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r}", param="response_id",
                    code="response_not_found")
