"""POST /v1/chat/completions: the messages rendered with the model's chat template, the
replies as assistant messages: reasoning split off (`--reasoning-parser`), then tool calls
parsed from the content when tools are offered (`required` or a named tool constrains the
reply with the parser's grammar).

Chat templates run off the event loop (in `PROMPT_POOL`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import Request
from starlette.responses import Response

from engine.async_engine import AsyncEngine
from engine.outputs import CompletionOutput, TokenLogprob
from engine.sampling_params import StructuredOutputsParams
from server.chat_protocol import ChatCompletionRequest
from server.errors import APIError
from server.generation import FINISH, Generation, check_prompt_bytes, finite
from server.metrics import RequestTracker
from server.reasoning import ReasoningParser, ReasoningStream
from server.tool_parsers import ToolCall, ToolCallDelta, ToolParser, ToolStream, parser_for_template

# Renders chat templates for all requests, off the event loop. Two threads: a long render holds
# the GIL in slices, so more would only slow the loop down, not the renders.
PROMPT_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chat-template")


class ChatGeneration(Generation):
    ID_PREFIX = "chatcmpl"
    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"
    CHUNK_CONTENT = "delta"

    def __init__(self, *args, tools: ToolParser | None = None,
                 reasoning: ReasoningParser | None = None, prompt: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = tools  # parses the replies' tool calls (when tools are offered)
        self.reasoning = reasoning  # splits the replies' reasoning off (--reasoning-parser)
        self.prompt = prompt  # the rendered chat: whether it opens a reasoning block
        # Per streamed choice: its reasoning and its tool calls as they come.
        self._reasoning_streams: dict[int, ReasoningStream] = {}
        self._tool_streams: dict[int, ToolStream] = {}

    def _check_prompt(self, prompt: str) -> None:
        check_prompt_bytes(self.engine, prompt, chat=True)

    def _choice(self, i: int, index: int, c: CompletionOutput) -> dict:
        message = {"role": "assistant", "content": c.text}
        if self.reasoning is not None:  # tool calls are parsed from the content alone
            message["reasoning_content"], message["content"] = self.reasoning.split(c.text)
        finish = FINISH.get(c.finish_reason)
        if self.tools is not None:
            content, calls = self.tools.parse(message["content"] or "")
            if calls:
                message.update(content=content, tool_calls=[_call(call) for call in calls])
                finish = "tool_calls"
        return {"index": index, "message": message,
                "logprobs": self._logprobs(c.logprobs) if c.logprobs is not None else None,
                "finish_reason": finish}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.engine.token_texts([token_id])[0]
            return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

    def _opening(self) -> Iterator[str]:
        # The role comes first, once per choice, as OpenAI sends it.
        for index in range(len(self.streams) * self.params.n):
            yield self._chunk(index, {"role": "assistant", "content": ""}, None, None)

    def _delta(self, index: int, c: CompletionOutput) -> tuple[dict, str | None] | None:
        """Reasoning split off first, then tool calls parsed from the content; None while
        what came may be the start of a tag or a call (and brings no logprobs)."""
        finish = FINISH.get(c.finish_reason)
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
        if not (delta or c.logprobs or finish):
            return None
        return delta, finish


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


async def create_chat_completion(request: Request, req: ChatCompletionRequest, model: str,
                                 engine: AsyncEngine, tracker: RequestTracker,
                                 reasoning: ReasoningParser | None = None,
                                 allow_special_tokens_in_messages: bool = False) -> Response:
    """`allow_special_tokens_in_messages`: special-token text in the request (`<|im_end|>` in a
    message) becomes those tokens, as it did before; by default only the template writes them."""
    gen = await start_chat(req, model, engine, tracker, reasoning,
                           allow_special_tokens_in_messages)
    return gen.stream_response() if req.stream else await gen.response(request)


async def start_chat(req: ChatCompletionRequest, model: str, engine: AsyncEngine,
                     tracker: RequestTracker, reasoning: ReasoningParser | None = None,
                     allow_special_tokens_in_messages: bool = False,
                     generation: type[ChatGeneration] = ChatGeneration,
                     **kwargs) -> ChatGeneration:
    """The chat request's generation (a `generation`, built with `kwargs` too), started: its
    chat rendered, its tool calls constrained when they must come."""
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
    gen = generation(model, engine, params, tracker, include_usage=req.include_usage,
                     return_token_ids=req.return_token_ids, cache_salt=req.cache_salt,
                     structured_param=structured_param, tools=parser, reasoning=reasoning,
                     prompt=prompt, **kwargs)
    # The template writes the special tokens (BOS included) itself.
    await gen.start([prompt], add_special_tokens=False)
    return gen
