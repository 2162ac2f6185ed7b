"""Request bodies of the OpenAI API (plus the usual engine extensions) as pydantic models.

Unknown fields are ignored, as OpenAI clients send fields that change nothing here
(`user`, `store`, `metadata`, ...). Fields we cannot honour are refused with a 400
naming them, never silently dropped. The same models generate /openapi.json.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json",
                                                description="A JSON schema the output follows.")
    json_object: bool | None = Field(None, description="Any JSON object.")
    regex: str | None = None
    choice: list[str] | None = Field(None, description="The output is one of these strings.")
    grammar: str | None = Field(None, description="A Lark (llguidance) or GBNF grammar.")

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, json_object=bool(self.json_object),
                                       regex=self.regex, choice=self.choice, grammar=self.grammar)


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
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="Constrain the output (vLLM extension): json, json_object, regex, "
                          "choice or grammar.")

    @property
    def structured_field(self) -> str:
        """The request field that constrains the output (what a grammar error names)."""
        return "structured_outputs"

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar the output follows."""
        return None if self.structured_outputs is None else self.structured_outputs.params()

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
            n=self.n, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured())

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
        if self.role == "assistant" and "content" not in message:
            message["content"] = None  # a turn of calls only (templates test for it)
        # Templates take a call's arguments as an object (transformers' convention); OpenAI
        # clients send them as JSON text.
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise SamplingParamsError("messages", "tool_calls must be a list")
            message["tool_calls"] = [_call_for_template(c) for c in calls]
        return message


def _call_for_template(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise SamplingParamsError("messages", f"a tool call needs function.name: {call!r}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise SamplingParamsError("messages", f"tool call {function['name']!r}: arguments "
                                      f"are not JSON ({e})") from None
    return {**call, "function": {**function, "arguments": arguments}}


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="Always enforced.")


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments.")
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    class _Name(BaseModel):
        name: str

    type: Literal["function"] = "function"
    function: _Name


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, description="Deprecated name of max_completion_tokens.")
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: 'auto' with tools, 'none' without.")
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {self.tool_choice.function.name!r} "
                             f"(tools: {', '.join(names) or 'none'})")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: only allowed when tools are given")
        return self

    @property
    def tool_mode(self) -> str:
        """'none', 'auto', 'required', or 'named' (self.tool_choice names the function)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def active_tools(self) -> list[Tool]:
        """The tools the reply may call (the named one alone for a named tool_choice)."""
        mode = self.tool_mode
        if mode == "none":
            return []
        if mode == "named":
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools)

    @property
    def structured_field(self) -> str:
        fmt = self.response_format
        return "structured_outputs" if fmt is None or fmt.type == "text" else "response_format"

    def structured(self) -> StructuredOutputsParams | None:
        if self.structured_field == "structured_outputs":
            return super().structured()
        if self.structured_outputs is not None:
            raise SamplingParamsError("response_format", "response_format and "
                                      "structured_outputs cannot both constrain the output")
        fmt = self.response_format
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise SamplingParamsError("response_format", "response_format json_schema needs "
                                      "json_schema.schema")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    def to_sampling_params(self) -> SamplingParams:
        constrained = (self.structured_outputs is not None
                       or self.structured_field != "structured_outputs")
        if self.tool_mode in ("required", "named") and constrained:
            raise SamplingParamsError("tool_choice", f"tool_choice {self.tool_mode!r} constrains "
                                      f"the output already; drop response_format / "
                                      f"structured_outputs")
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
