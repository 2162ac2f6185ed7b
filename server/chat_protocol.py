"""The request bodies that carry chat messages, as pydantic models: /v1/chat/completions
(messages, tools and tool_choice checked against each other, response_format, template
arguments) and /tokenize. The sampling fields they share with completions, and the schema
helpers, are in server/protocol.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from server.protocol import (
    SAMPLING_RULES,
    MaxTokens,
    SamplingRequest,
    given,
    rules,
    served,
    when,
)
from server.strict_json import InvalidJSON, parse_json

MAX_MESSAGES = 4096  # messages in one chat request


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # tool_calls, ... reach the template. The schema asks every message for its content, as
    # templates do (a turn of tool calls, which the schema leaves undescribed, may go without).
    model_config = ConfigDict(extra="allow", json_schema_extra=rules(
        given("content"), when(given("role", {"const": "tool"}),
                                 given("tool_call_id", {"type": "string", "minLength": 1}))))

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="Required, except on an assistant turn with tool_calls.")
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
            arguments = parse_json(arguments) if arguments.strip() else {}
        except InvalidJSON as e:
            raise SamplingParamsError("messages", f"tool call {function['name']!r}: arguments "
                                      f"are not JSON ({e})") from None
    return {**call, "function": {**function, "arguments": arguments}}


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="Always enforced.")


class ResponseFormat(BaseModel):
    # (checked in ChatCompletionRequest.structured)
    model_config = ConfigDict(json_schema_extra=rules(when(
        given("type", {"const": "json_schema"}),
        given("json_schema", {"required": ["schema"],
                               "properties": {"schema": {"type": "object"}}}))))

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


_CONSTRAINS = {"type": "object", "properties": {"type": {"enum": ["json_object", "json_schema"]}}}
_NO_CONSTRAINT = {"properties": {"structured_outputs": {"type": "null"}, "response_format": {
    "anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}}}
# Rules of a chat request (checked in _tool_choice_names_a_tool and to_sampling_params); that a
# named tool_choice names one of the tools, and that tool names are unique, JSON Schema cannot say.
_CHAT_RULES = (
    when(given("top_logprobs"), given("logprobs", {"const": True})),
    when(given("tool_choice", {"not": {"enum": ["none", None]}}),
          given("tools", {"type": "array", "minItems": 1})),
    when(given("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]}),
          _NO_CONSTRAINT),
    when(given("response_format", _CONSTRAINS),
          {"properties": {"structured_outputs": {"type": "null"}}}),
)
# What chat_template_kwargs cannot override: the template's own arguments (the request's fields
# set them), the model's tokens (its files do) and the helpers transformers gives templates.
_TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token",
                       "raise_exception", "strftime_now")


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra=rules(*SAMPLING_RULES, *_CHAT_RULES))

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: MaxTokens | None = Field(None,
                                         description="Deprecated name of max_completion_tokens.")
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: 'auto' with tools, 'none' without.")
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template.",
        json_schema_extra={"propertyNames": {"not": {"enum": list(_TEMPLATE_ARGUMENTS)}}})

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_template_arguments(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        given = [k for k in _TEMPLATE_ARGUMENTS if k in (kwargs or {})]
        if given:
            raise ValueError(f"{', '.join(given)}: set by the server (from the request's own "
                             f"fields or the model's files), not by chat_template_kwargs")
        return kwargs

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

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
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
        return self.sampling_params(max_tokens, logprobs, defaults)


class TokenizeRequest(BaseModel):
    # (checked by the handler)
    model_config = ConfigDict(json_schema_extra={"oneOf": [given("prompt"), given("messages")]})

    model: str | None = Field(None, json_schema_extra=served("model"))
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
