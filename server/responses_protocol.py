"""The body of POST /v1/responses (OpenAI's Responses API) as a pydantic model, and its
translation into the chat request the rest of the server already runs: input items become
chat messages (a function call the model made, its output from the client), function tools
and `tool_choice` their chat forms, `text.format` a `response_format`, `max_output_tokens`
`max_completion_tokens`. What JSON Schema can say is in /openapi.json, as for chat.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from engine.sampling_params import INT_MAX, SamplingParamsError
from server.chat_protocol import MAX_MESSAGES, ChatCompletionRequest
from server.protocol import LogitBias, MaxTokens, given, rules, served, when
from server.strict_json import InvalidJSON, parse_json

# Fields a Responses body may carry that a chat request samples with the same way (the
# sampling extensions this server accepts on chat are accepted here too).
_SAMPLING_FIELDS = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "logit_bias", "cache_salt",
                    "stream")
# Where a chat field's error points in a Responses body.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text", "tools": "tools", "tool_choice": "tool_choice"}


class InputText(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


def _joined(content: str | list[InputText]) -> str:
    """Text parts joined, as OpenAI does."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(BaseModel):
    """A call the model made (sent back by the client with the call's output)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]

    def text(self) -> str:
        return _joined(self.output)


class ReasoningItem(BaseModel):
    """The model's earlier reasoning, sent back by clients; chat templates drop it."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class _EasyMessage(MessageItem):
    """A message without its `type` (the "easy input message" clients send most)."""

    type: Literal["message"] | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    # (checked by chat's ResponseFormat)
    model_config = ConfigDict(extra="ignore", json_schema_extra=rules(when(
        given("type", {"const": "json_schema"}), given("schema", {"type": "object"}))))

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="ignore")

    effort: str | None = None
    summary: str | None = None


# (checked in chat_request: an input of reasoning items alone has nothing to answer)
_NOT_REASONING = {"not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}
# Rules of a Responses body (checked in ResponsesRequest._check and by the chat request's
# validation), as JSON Schema says them.
_TOOL_CHOSEN = given("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]})
_RULES = (
    when(given("tool_choice", {"not": {"enum": ["none", None]}}),
          given("tools", {"type": "array", "minItems": 1})),
    when(_TOOL_CHOSEN, {"properties": {"text": {"anyOf": [{"type": "null"}, {"properties": {
        "format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}}}]}}}),
)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=rules(*_RULES))

    model: str | None = Field(None, description="Served model name; optional with one model.",
                              json_schema_extra=served("model"))
    input: Annotated[str, Field(min_length=1)] | Annotated[
        list[_EasyMessage | InputItem], Field(min_length=1, max_length=MAX_MESSAGES,
                                              json_schema_extra={"contains": _NOT_REASONING})]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: MaxTokens | None = None
    # The sampling fields' bounds are chat's (server/protocol.py, SamplingRequest).
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Sampling extensions, as on chat completions.
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    top_k: int | None = Field(None, ge=-1, le=INT_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: LogitBias = None
    cache_salt: str | None = None
    # What this server cannot honour is refused (a 400 naming the field), never dropped.
    background: Literal[False] | None = Field(None, description="Not supported (400 if true).")
    truncation: Literal["disabled"] | None = Field(None, description="Only 'disabled'.")
    top_logprobs: Literal[0] | None = Field(None, description="Not supported (400 if > 0).")
    conversation: Annotated[Any, WithJsonSchema({"type": "null", "description":
                                                 "Not supported: use previous_response_id."})
                            ] = None
    prompt: Annotated[Any, WithJsonSchema({"type": "null",
                                           "description": "Not supported (stored prompts)."})
                      ] = None

    @field_validator("conversation", "prompt")
    @classmethod
    def _unsupported(cls, value, info):
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported"
                             + (": continue a response with previous_response_id"
                                if info.field_name == "conversation" else ""))
        return value

    def input_messages(self) -> list[dict]:
        """This request's input as chat messages (the instructions not included)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": _json_text(item.arguments)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)  # the same turn's calls
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.text()})
        return messages

    def chat_request(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat request this response runs: the instructions, `history` (the stored
        conversation this one continues), then this request's input."""
        self._check()
        messages = ([{"role": "system", "content": self.instructions}]
                    if self.instructions else []) + history + self.input_messages()
        if not messages:
            raise SamplingParamsError("input", "input: no message to answer")
        body: dict[str, Any] = {"messages": messages, "n": 1,
                                "parallel_tool_calls": self.parallel_tool_calls}
        body.update({name: getattr(self, name) for name in _SAMPLING_FIELDS
                     if getattr(self, name) is not None and name in self.model_fields_set})
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = (
                {"type": "json_object"} if fmt.type == "json_object" else
                {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                        "strict": fmt.strict}})
        return ChatCompletionRequest.model_validate(body)

    def _check(self) -> None:
        """What the chat request's own checks would say without naming a field."""
        names = [t.name for t in self.tools or ()]
        if self.tool_choice not in (None, "none") and not names:
            raise SamplingParamsError("tool_choice", "tool_choice: only allowed when tools are "
                                                     "given")
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in names:
            raise SamplingParamsError("tool_choice", f"tool_choice: no tool named "
                                      f"{self.tool_choice.name!r} (tools: "
                                      f"{', '.join(names) or 'none'})")
        if len(set(names)) != len(names):
            raise SamplingParamsError("tools", "tools: function names must be unique")

    def echo(self) -> dict:
        """The request's settings as the response object repeats them."""
        fmt = (self.text.format.model_dump(by_alias=True, exclude_none=True)
               if self.text is not None and self.text.format is not None else {"type": "text"})
        tool_choice = (self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction)
                       else self.tool_choice or ("auto" if self.tools else "none"))
        return {"instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {},
                "parallel_tool_calls": self.parallel_tool_calls,
                "previous_response_id": self.previous_response_id,
                "reasoning": self.reasoning.model_dump() if self.reasoning else None,
                "store": self.store,
                "temperature": self.temperature,
                "text": {"format": fmt},
                "tool_choice": tool_choice,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
                "top_p": self.top_p,
                "truncation": "disabled",
                "user": self.user}


def _json_text(arguments: str) -> str:
    """A call's arguments as JSON text: ones that are not (a client's own edit) go to the
    template as a string, rather than refusing the conversation."""
    try:
        parse_json(arguments)
    except InvalidJSON:
        return json.dumps(arguments)
    return arguments


def chat_param(param: str | None) -> str | None:
    """The Responses field a chat field's error is about."""
    if param is None:
        return None
    return _PARAMS.get(param, param)
