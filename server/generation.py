"""The shared core of /v1/completions and /v1/chat/completions (server/completions.py,
server/chat.py): prompts in, choices out, whole or streamed.

A request's prompts (a batch for completions, one rendered chat otherwise) each
become one engine request with `n` sequences; choice `i * n + j` is sequence `j`
of prompt `i`. Whatever way the HTTP exchange ends (done, error, client gone), every
engine request it started is closed, which aborts the unfinished ones.

Work on a prompt is bounded before it starts: a prompt text longer in bytes than
`max_model_len` tokens could spell is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.async_engine import AsyncEngine
from engine.grammar import GrammarError
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob, accumulate
from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams
from server.errors import APIError, api_error
from server.metrics import RequestTracker

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# --stream-stall-timeout: a streamed response whose write waits longer than this (the client
# stopped reading and the connection's buffers are full) is ended and its requests aborted.
# The app sets its own (`app.state.stream_stall_timeout`; None turns the check off).
STREAM_STALL_TIMEOUT_S = 60.0

logger = logging.getLogger(__name__)


class Generation:
    """One completions or chat request from start to its last byte. A subclass says what its
    choices, chunks and logprobs look like (CompletionGeneration, ChatGeneration)."""

    ID_PREFIX: str  # of the response's id
    OBJECT: str  # the whole response's "object"
    CHUNK_OBJECT: str  # a streamed chunk's "object"
    CHUNK_CONTENT: str  # the key of a streamed choice's content

    def __init__(self, model: str, engine: AsyncEngine, params: SamplingParams,
                 tracker: RequestTracker, include_usage: bool = False,
                 return_token_ids: bool = False, cache_salt: str | None = None,
                 structured_param: str = "structured_outputs", session: str | None = None):
        self.structured_param = structured_param  # the request field a grammar error names
        self.session = session  # a stored conversation that keeps the blocks once it finishes
        self.model = model
        self.engine = engine
        self.params = params
        self.tracker = tracker
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.cache_salt = cache_salt
        self.id = f"{self.ID_PREFIX}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.streams: list[RequestStream] = []
        self.last: dict[int, RequestOutput] = {}

    # ---- what a subclass says -----------------------------------------------------------

    def _check_prompt(self, prompt: str) -> None:
        """Raises an APIError for a text prompt too long to tokenize."""
        raise NotImplementedError

    def _accepted(self, prompt: str | list[int]) -> None:
        """Called once a prompt's engine request is started."""

    def _choice(self, i: int, index: int, c: CompletionOutput) -> dict:
        """Choice `index` of a whole response: prompt i's output c, all of it."""
        raise NotImplementedError

    def _logprobs(self, lps: list[TokenLogprob]) -> dict:
        """A streamed chunk's logprobs (of the new tokens)."""
        raise NotImplementedError

    def _opening(self) -> Iterator[str]:
        """The events a stream starts with, before any output."""
        return iter(())

    def _delta(self, index: int, c: CompletionOutput) -> tuple[object, str | None] | None:
        """A streamed choice's content for one output, and its finish_reason; None when the
        chunk is held back."""
        raise NotImplementedError

    # ---- engine requests ----------------------------------------------------------------

    async def start(self, prompts: list[str | list[int]], add_special_tokens: bool) -> None:
        try:
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, str):
                    self._check_prompt(prompt)
                try:
                    stream = await self.engine.add_request(prompt, self.params, f"{self.id}-{i}",
                                                           add_special_tokens, self.cache_salt,
                                                           self.session)
                except GrammarError as e:
                    raise APIError(400, str(e), param=self.structured_param) from None
                self.streams.append(stream)
                self.tracker.accepted(len(stream.prompt_token_ids))
                self._accepted(prompt)
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
        if not await self.finish(request):
            return Response(status_code=499)
        return JSONResponse(self.body())

    async def finish(self, request: Request) -> bool:
        """Runs the request to its end; False when the client left first (everything is
        aborted then, and no one is answered)."""
        collect = asyncio.create_task(self._collect())
        gone = asyncio.create_task(disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left: abort everything, answer no one
                collect.cancel()
                self.close()
        if not collect.done():
            return False
        collect.result()  # engine errors raise here
        return True

    def body(self) -> dict:
        """The whole response, once `finish` returned True."""
        choices = []
        for i in range(len(self.streams)):
            for c in self.last[i].outputs:
                choice = self._choice(i, i * self.params.n + c.index, c)
                if self.return_token_ids:
                    choice.update(prompt_token_ids=self.streams[i].prompt_token_ids,
                                  token_ids=c.token_ids)
                choices.append(choice)
        return {"id": self.id, "object": self.OBJECT, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}

    async def _collect(self) -> None:
        async for _ in self.outputs(logprobs=True):
            pass

    def usage(self) -> dict:
        prompt = sum(len(s.prompt_token_ids) for s in self.streams)
        completion = sum(len(c.token_ids) for out in self.last.values() for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in self.last.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- streams ------------------------------------------------------------------------

    def stream_response(self) -> Response:
        return ClosingStream(self._events(), self.close, media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self) -> AsyncIterator[str]:
        n = self.params.n
        finished: set[int] = set()
        try:
            for event in self._opening():
                yield event
            async for i, out in self.outputs():
                for c in out.outputs:
                    index = i * n + c.index
                    if index in finished:
                        continue
                    lps = c.logprobs or None  # (a delta: the new tokens' logprobs)
                    if not (c.text or lps or c.finish_reason):
                        continue
                    logprobs = self._logprobs(lps) if lps else None
                    delta = self._delta(index, c)
                    if delta is None:
                        continue
                    content, finish = delta
                    yield self._chunk(index, content, logprobs, finish, c.token_ids)
                    if c.finish_reason:
                        finished.add(index)
            if self.include_usage:
                yield sse({"id": self.id, "object": self.CHUNK_OBJECT,
                           "created": self.created, "model": self.model, "choices": [],
                           "usage": self.usage()})
        except Exception as e:  # mid-stream failure: an error event, then [DONE]
            yield sse(api_error(e).body())
        yield "data: [DONE]\n\n"

    def _chunk(self, index: int, content, logprobs, finish_reason,
               token_ids: list[int] = ()) -> str:
        choice = {"index": index, self.CHUNK_CONTENT: content}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        body = {"id": self.id, "object": self.CHUNK_OBJECT, "created": self.created,
                "model": self.model, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)


class _Stalled(Exception):
    pass


class ClosingStream(StreamingResponse):
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


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finite(logprob: float) -> float:
    return max(float(logprob), -9999.0)  # JSON has no -inf


async def disconnected(request: Request) -> None:
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
