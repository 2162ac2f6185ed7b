"""POST /v1/completions and /v1/chat/completions: prompts in, choices out, whole or streamed.

A request's prompts (a batch for completions, one rendered chat otherwise) each
become one engine request with `n` sequences; choice `i * n + j` is sequence `j`
of prompt `i`. Whatever way the HTTP exchange ends (done, error, client gone), every
engine request it started is closed, which aborts the unfinished ones.

Work on a prompt is bounded before it starts: chat templates run off the event loop (in
`PROMPT_POOL`), and a prompt text longer in bytes than `max_model_len` tokens could spell is
refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.async_engine import AsyncEngine, RequestStream
from engine.grammar import GrammarError
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob, accumulate
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from server.errors import APIError, api_error
from server.metrics import RequestTracker
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.reasoning import ReasoningParser, ReasoningStream
from server.tool_parsers import ToolCall, ToolCallDelta, ToolParser, ToolStream, parser_for_template

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# Renders chat templates for all requests, off the event loop. Two threads: a long render holds
# the GIL in slices, so more would only slow the loop down, not the renders.
PROMPT_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chat-template")
# --stream-stall-timeout: a streamed response whose write waits longer than this (the client
# stopped reading and the connection's buffers are full) is ended and its requests aborted.
# The app sets its own (`app.state.stream_stall_timeout`; None turns the check off).
STREAM_STALL_TIMEOUT_S = 60.0

logger = logging.getLogger(__name__)


class Generation:
    """One completions or chat request from start to its last byte."""

    def __init__(self, chat: bool, model: str, engine: AsyncEngine, params: SamplingParams,
                 tracker: RequestTracker, echo: bool = False, include_usage: bool = False,
                 return_token_ids: bool = False, cache_salt: str | None = None,
                 tools: ToolParser | None = None, structured_param: str = "structured_outputs",
                 reasoning: ReasoningParser | None = None, prompt: str = ""):
        self.chat = chat
        self.tools = tools  # parses the replies' tool calls (chat with tools offered)
        self.reasoning = reasoning  # splits the replies' reasoning off (chat, --reasoning-parser)
        self.prompt = prompt  # the rendered chat: whether it opens a reasoning block
        self.structured_param = structured_param  # the request field a grammar error names
        self.model = model
        self.engine = engine
        self.params = params
        self.tracker = tracker
        self.echo = echo
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.cache_salt = cache_salt
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.streams: list[RequestStream] = []
        self.prompt_texts: list[str] = []
        self.last: dict[int, RequestOutput] = {}
        # Per streamed chat choice: its reasoning and its tool calls as they come.
        self._reasoning_streams: dict[int, ReasoningStream] = {}
        self._tool_streams: dict[int, ToolStream] = {}

    async def start(self, prompts: list[str | list[int]], add_special_tokens: bool) -> None:
        try:
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, str):
                    check_prompt_bytes(self.engine, prompt, self.chat)
                try:
                    stream = await self.engine.add_request(prompt, self.params, f"{self.id}-{i}",
                                                           add_special_tokens, self.cache_salt)
                except GrammarError as e:
                    raise APIError(400, str(e), param=self.structured_param) from None
                self.streams.append(stream)
                self.tracker.accepted(len(stream.prompt_token_ids))
                if self.echo:
                    self.prompt_texts.append(prompt if isinstance(prompt, str)
                                             else self.engine.decode(prompt))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    async def outputs(self, logprobs: bool = False) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all prompts as they come. The outputs are deltas;
        `self.last[i]` folds prompt i's into its whole output so far (with the logprobs only
        when asked: a stream has sent them)."""
        # Bounded: while the consumer is not reading, outputs wait on the engine's streams,
        # whose backlog is bounded, instead of piling up here.
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(self.streams))

        async def pump(i: int, stream: RequestStream):
            try:
                async for out in stream:
                    await queue.put((i, out))
            except Exception as e:
                await queue.put((i, e))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                self.tracker.output(item)
                self.last[i] = accumulate(self.last.get(i), item, logprobs)
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            self.close()

    # ---- whole responses ----------------------------------------------------------------

    async def response(self, request: Request) -> Response:
        collect = asyncio.create_task(self._collect())
        gone = asyncio.create_task(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left: abort everything, answer no one
                collect.cancel()
                self.close()
        if not collect.done():
            return Response(status_code=499)
        collect.result()  # engine errors raise here
        choices = []
        for i in range(len(self.streams)):
            for c in self.last[i].outputs:
                choices.append(self._choice(i, c))
        return JSONResponse({"id": self.id, "object": self._object(False),
                             "created": self.created, "model": self.model,
                             "choices": choices, "usage": self.usage()})

    async def _collect(self) -> None:
        async for _ in self.outputs(logprobs=True):
            pass

    def _choice(self, i: int, c: CompletionOutput) -> dict:
        index = i * self.params.n + c.index
        if self.chat:
            message = {"role": "assistant", "content": c.text}
            if self.reasoning is not None:  # tool calls are parsed from the content alone
                message["reasoning_content"], message["content"] = self.reasoning.split(c.text)
            finish = _FINISH.get(c.finish_reason)
            if self.tools is not None:
                content, calls = self.tools.parse(message["content"] or "")
                if calls:
                    message.update(content=content, tool_calls=[_call(call) for call in calls])
                    finish = "tool_calls"
            choice = {"index": index, "message": message,
                      "logprobs": self._chat_logprobs(c.logprobs), "finish_reason": finish}
        else:
            prefix = self.prompt_texts[i] if self.echo else ""
            choice = {"index": index, "text": prefix + c.text,
                      "logprobs": self._completion_logprobs(c.logprobs, len(prefix)),
                      "finish_reason": _FINISH.get(c.finish_reason)}
        if self.return_token_ids:
            choice.update(prompt_token_ids=self.streams[i].prompt_token_ids,
                          token_ids=c.token_ids)
        return choice

    def usage(self) -> dict:
        prompt = sum(len(s.prompt_token_ids) for s in self.streams)
        completion = sum(len(c.token_ids) for out in self.last.values() for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in self.last.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _object(self, chunk: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    # ---- logprobs -----------------------------------------------------------------------

    def _completion_logprobs(self, lps: list[TokenLogprob] | None, offset: int) -> dict | None:
        if lps is None:
            return None
        tokens = self.engine.token_texts([lp.token_id for lp in lps])
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in lps],
                "top_logprobs": [
                    {text: _finite(v) for text, (_, v) in zip(
                        self.engine.token_texts([t for t, _ in lp.top]), lp.top, strict=True)}
                    for lp in lps],
                "text_offset": offsets}

    def _chat_logprobs(self, lps: list[TokenLogprob] | None) -> dict | None:
        if lps is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.engine.token_texts([token_id])[0]
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

    # ---- streams ------------------------------------------------------------------------

    def stream_response(self) -> Response:
        return _ClosingStream(self._events(), self.close, media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self) -> AsyncIterator[str]:
        n = self.params.n
        finished: set[int] = set()
        try:
            if self.chat:  # the role comes first, once per choice, as OpenAI sends it
                for index in range(len(self.streams) * n):
                    yield self._chunk(index, {"role": "assistant", "content": ""}, None, None)
            elif self.echo:
                for i, text in enumerate(self.prompt_texts):
                    for j in range(n):
                        yield self._chunk(i * n + j, text, None, None)
            async for i, out in self.outputs():
                for c in out.outputs:
                    index = i * n + c.index
                    if index in finished:
                        continue
                    lps = c.logprobs or None  # (a delta: the new tokens' logprobs)
                    if not (c.text or lps or c.finish_reason):
                        continue
                    logprobs = (self._chat_logprobs(lps) if self.chat
                                else self._completion_logprobs(lps, 0)) if lps else None
                    if self.chat:
                        content, finish = self._chat_delta(index, c)
                        if not (content or lps or finish):
                            continue  # held back: maybe the start of a tag or a call
                    else:
                        content, finish = c.text, _FINISH.get(c.finish_reason)
                    yield self._chunk(index, content, logprobs, finish, c.token_ids)
                    if c.finish_reason:
                        finished.add(index)
            if self.include_usage:
                yield _sse({"id": self.id, "object": self._object(True),
                            "created": self.created, "model": self.model, "choices": [],
                            "usage": self.usage()})
        except Exception as e:  # mid-stream failure: an error event, then [DONE]
            yield _sse(api_error(e).body())
        yield "data: [DONE]\n\n"

    def _chat_delta(self, index: int, c: CompletionOutput) -> tuple[dict, str | None]:
        """A chat choice's delta for one output, and its finish_reason: reasoning split off
        first, then tool calls parsed from the content."""
        finish = _FINISH.get(c.finish_reason)
        delta: dict = {}
        text = c.text  # (the output is a delta)
        if self.reasoning is not None:
            thinking = self._reasoning_streams.setdefault(index,
                                                          self.reasoning.stream(self.prompt))
            thought, text = thinking.feed(text)
            if c.finish_reason:
                more_thought, more = thinking.finish()
                thought, text = thought + more_thought, text + more
            if thought:
                delta["reasoning_content"] = thought
        if self.tools is not None:
            calls = self._tool_streams.setdefault(index, self.tools.stream())
            text, deltas = calls.feed(text)
            if c.finish_reason:
                more, last = calls.finish()
                text, deltas = text + more, deltas + last
                finish = "tool_calls" if calls.calls else finish
            if deltas:
                delta["tool_calls"] = [_call_delta(d) for d in deltas]
        plain = self.reasoning is None and self.tools is None
        if text or (plain and not c.finish_reason):  # (plain: logprobs alone come with "")
            delta = {"content": text, **delta}
        return delta, finish

    def _chunk(self, index: int, content, logprobs, finish_reason,
               token_ids: list[int] = ()) -> str:
        choice = ({"index": index, "delta": content} if self.chat
                  else {"index": index, "text": content})
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        body = {"id": self.id, "object": self._object(True), "created": self.created,
                "model": self.model, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return _sse(body)


class _Stalled(Exception):
    pass


class _ClosingStream(StreamingResponse):
    """A streamed response that closes its engine requests however it ends (even when
    the client leaves before the first byte, when the body iterator never starts), and
    that ends when a write has waited longer than the stall timeout: a client that stopped
    reading blocks `send` once the connection's buffers are full, and without this would
    hold its engine requests (their KV pages and the outputs nobody reads) for good."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        app_state = getattr(scope.get("app"), "state", None)
        timeout = getattr(app_state, "stream_stall_timeout", STREAM_STALL_TIMEOUT_S)

        async def send_or_stall(message):
            try:
                async with asyncio.timeout(timeout or None):
                    await send(message)
            except TimeoutError:
                raise _Stalled from None

        try:
            await super().__call__(scope, receive, send_or_stall)
        except _Stalled:  # returning unfinished: the server closes the connection
            client = scope.get("client") or ("?", 0)
            logger.warning("Stream to %s:%s (%s) closed: no write completed in %g s (the "
                           "client stopped reading); its requests are aborted",
                           client[0], client[1], scope.get("path"), timeout)
        finally:
            self._on_close()
            try:  # its generators' cleanup now (outputs() cancels its readers), not at GC
                await self.body_iterator.aclose()
            except RuntimeError:  # (already running: it ends with its own task)
                pass


def _call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _call_delta(d: ToolCallDelta) -> dict:
    """OpenAI's streamed form: id, type and name on a call's first piece only."""
    out: dict = {"index": d.index}
    if d.id is not None:
        out.update(id=d.id, type="function", function={"name": d.name, "arguments": d.arguments})
    else:
        out["function"] = {"arguments": d.arguments}
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _finite(logprob: float) -> float:
    return max(float(logprob), -9999.0)  # JSON has no -inf


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def check_prompt_bytes(engine: AsyncEngine, prompt: str, chat: bool) -> None:
    """A 400 for a text longer than `max_model_len` tokens of this model can spell, before
    anyone tokenizes it: the engine's length check needs the tokens, and a multi-megabyte text
    takes seconds to tokenize."""
    per_token = engine.tokenizer.max_token_bytes
    limit = engine.max_model_len * per_token
    if len(prompt) > limit or len(prompt.encode("utf-8", "surrogatepass")) > limit:
        what = "the rendered chat" if chat else "the prompt"
        raise APIError(400, f"{what} is more than {limit} bytes long: more than this model's "
                            f"maximum context length of {engine.max_model_len} tokens can hold "
                            f"(at most {per_token} bytes a token)",
                       param="messages" if chat else "prompt", code="context_length_exceeded")


def _render_chat(engine: AsyncEngine, req: ChatCompletionRequest
                 ) -> tuple[str, ToolParser | None]:
    """The chat's prompt text and the parser of its replies' tool calls (in PROMPT_POOL)."""
    extra = dict(req.chat_template_kwargs or {})
    parser = None
    try:
        if req.tool_mode != "none":
            parser = parser_for_template(engine.chat_template.source)
            extra["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        prompt = engine.render_chat([m.for_template() for m in req.messages],
                                    req.add_generation_prompt, **extra)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    return prompt, parser


# ---- the two endpoints ----------------------------------------------------------------------


async def create_completion(request: Request, req: CompletionRequest, model: str,
                            engine: AsyncEngine, tracker: RequestTracker) -> Response:
    gen = Generation(False, model, engine, req.to_sampling_params(engine.sampling_defaults),
                     tracker, echo=req.echo,
                     include_usage=req.include_usage, return_token_ids=req.return_token_ids,
                     cache_salt=req.cache_salt)  # (a grammar here comes from structured_outputs)
    await gen.start(req.prompts(), add_special_tokens=True)
    return gen.stream_response() if req.stream else await gen.response(request)


async def create_chat_completion(request: Request, req: ChatCompletionRequest, model: str,
                                 engine: AsyncEngine, tracker: RequestTracker,
                                 reasoning: ReasoningParser | None = None,
                                 allow_special_tokens_in_messages: bool = False) -> Response:
    """`allow_special_tokens_in_messages`: special-token text in the request (`<|im_end|>` in a
    message) becomes those tokens, as it did before; by default only the template writes them."""
    params = req.to_sampling_params(engine.sampling_defaults)
    structured_param = req.structured_field
    prompt, parser = await asyncio.get_running_loop().run_in_executor(
        PROMPT_POOL, _render_chat, engine, req)
    if allow_special_tokens_in_messages:
        prompt = str(prompt)  # a plain str: every special token's text is parsed
    if req.tool_mode in ("required", "named"):  # the reply is calls: constrain it to them
        tools = [{"name": t.function.name, "parameters": t.function.parameters}
                 for t in req.active_tools()]
        grammar = parser.grammar(tools, req.parallel_tool_calls and req.tool_mode == "required")
        params = dataclasses.replace(params,
                                     structured_outputs=StructuredOutputsParams(grammar=grammar))
        structured_param = "tools"
    gen = Generation(True, model, engine, params, tracker, include_usage=req.include_usage,
                     return_token_ids=req.return_token_ids, cache_salt=req.cache_salt,
                     tools=parser, structured_param=structured_param, reasoning=reasoning,
                     prompt=prompt)
    # The template writes the special tokens (BOS included) itself.
    await gen.start([prompt], add_special_tokens=False)
    return gen.stream_response() if req.stream else await gen.response(request)
