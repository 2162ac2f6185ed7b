"""Request bodies of the OpenAI API (plus the usual engine extensions) as pydantic models.

Unknown fields are ignored, as OpenAI clients send fields that change nothing here
(`user`, `store`, `metadata`, ...). Fields we cannot honour are refused with a 400
naming them, never silently dropped. The same models generate /openapi.json.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import SamplingParams, SamplingParamsError


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Served model name; optional with one model.")
    n: int = Field(1, description="Choices per prompt.")
    best_of: int | None = Field(None, description="Only best_of == n is supported.")
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Not supported (400 if set).")
    user: str | None = None
    # Engine extensions, as in vLLM.
    top_k: int = Field(0, description="0 or -1: off.")
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = Field(False, description="Add prompt_token_ids and token_ids to "
                                                      "each choice (vLLM extension).")
    cache_salt: str | None = Field(None, description="Prefix-cache namespace (vLLM extension): "
                                   "only requests with the same salt share cached prompt "
                                   "blocks.")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise SamplingParamsError("best_of", "best_of different from n is not supported")
        if self.logit_bias:
            raise SamplingParamsError("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options",
                                      "stream_options is only allowed when stream is true")
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=tuple([self.stop] if isinstance(self.stop, str)
                                                   else self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            n=self.n, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text, token ids, or a batch of either.")
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="Top-N logprobs per token (N <= 20).")
    echo: bool = False
    suffix: str | None = Field(None, description="Not supported (400 if set).")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a (possibly batched) request."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise SamplingParamsError("suffix", "suffix is not supported")
        return self.sampling_params(self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, ... reach the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = Field(None, description="Required for role 'tool'.")

    @model_validator(mode="after")
    def _tool_messages_answer_a_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs tool_call_id")
        return self

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # text parts are joined, as OpenAI does
            message["content"] = "".join(part.text for part in self.content)
        return message


class ResponseFormat(BaseModel):
    type: str


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, description="Deprecated name of max_completion_tokens.")
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported (400 if given).")
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = Field(None, description="Only type 'text'.")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.tools:
            raise SamplingParamsError("tools", "tool calling is not supported")
        if self.response_format is not None and self.response_format.type != "text":
            raise SamplingParamsError("response_format",
                                      f"response_format {self.response_format.type!r} is not "
                                      f"supported; only 'text'")
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        return self.sampling_params(max_tokens, logprobs)


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
