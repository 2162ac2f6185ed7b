"""Request bodies of the OpenAI API (plus the usual engine extensions) as pydantic models.

Unknown fields are ignored, as OpenAI clients send fields that change nothing here
(`user`, `store`, `metadata`, ...). Fields we cannot honour are refused with a 400
naming them, never silently dropped. The same models generate /openapi.json: every range,
length and enum a field is validated against is in its schema, and so are the rules that tie
fields together (JSON Schema `if`/`then` beside the validator that enforces them). A request
that follows the schema is refused only for what JSON Schema cannot say: its prompt's length
in tokens, a grammar that does not compile, fields compared with each other (min_tokens and
max_tokens, unique tool names, the tool a tool_choice names).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from engine.sampling_params import (
    INT_MAX,
    MAX_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from server.strict_json import InvalidJSON, parse_json

MAX_MESSAGES = 4096  # messages in one chat request
MAX_PROMPTS = 256    # prompts in one completions request (each runs n sequences)


# Fields whose bounds depend on the served models carry an "x-served" mark that
# server/openapi.py replaces with those bounds: the served model names, a token id below the
# vocabulary size, at most max_model_len - 1 tokens (a prompt needs one).
def _served(what: str) -> dict:
    return {"x-served": what}


TokenId = Annotated[int, Field(ge=0, json_schema_extra=_served("token_id"))]
StopString = Annotated[str, Field(min_length=1)]


def _rules(*rules: dict):
    """json_schema_extra adding rules across fields (enforced by the model's validators)."""
    def extra(schema: dict) -> None:
        schema.setdefault("allOf", []).extend(rules)
    return extra


def _given(field: str, schema: dict | None = None) -> dict:
    """The JSON Schema condition 'field is present and matches schema (default: not null)'."""
    return {"required": [field],
            "properties": {field: schema if schema is not None else {"not": {"type": "null"}}}}


def _when(condition: dict, then: dict) -> dict:
    return {"if": condition, "then": then}


class StreamOptions(BaseModel):
    include_usage: bool = False


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one of these."""

    # (SamplingParams checks that exactly one is given.)
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        _given("json"), _given("json_object", {"const": True}), _given("regex"),
        _given("choice"), _given("grammar")]})

    json_: dict[str, Any] | str | None = Field(None, alias="json",
                                                description="A JSON schema the output follows.")
    json_object: bool | None = Field(None, description="Any JSON object.")
    regex: str | None = None
    choice: list[StopString] | None = Field(None, min_length=1,
                                            description="The output is one of these strings.")
    grammar: str | None = Field(None, description="A Lark (llguidance) or GBNF grammar.")

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, json_object=bool(self.json_object),
                                       regex=self.regex, choice=self.choice, grammar=self.grammar)


# A rule every generation request follows (checked in _Request.sampling_params).
_SAMPLING_RULES = (_when(_given("stream_options"), _given("stream", {"const": True})),)
# best_of must equal n, which JSON Schema can only say with a branch per value of n; schema
# generators (schemathesis) then take several times longer per request, so the schema asks
# for null and the description says the rest.
_BEST_OF = {"type": "null", "description": "Only best_of == n is supported (and changes nothing)."}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_rules(*_SAMPLING_RULES))

    model: str | None = Field(None, description="Served model name; optional with one model.",
                              json_schema_extra=_served("model"))
    n: int = Field(1, ge=1, le=16, description="Choices per prompt.")
    best_of: Annotated[int | None, WithJsonSchema(_BEST_OF)] = None
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Not supported (400 if set).",
                                                json_schema_extra={"maxProperties": 0})
    user: str | None = None
    # Engine extensions, as in vLLM.
    top_k: int = Field(0, ge=-1, le=INT_MAX, description="0 or -1: off.")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    min_tokens: int = Field(0, ge=0, le=INT_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT_MAX)]] | None = Field(
        None, max_length=12)
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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        """`defaults`: the served model's sampling values (models.generation_config), for the
        fields this request leaves unset; a value the request sends wins, as in vLLM."""
        if self.best_of is not None and self.best_of != self.n:
            raise SamplingParamsError("best_of", "best_of different from n is not supported")
        if self.logit_bias:
            raise SamplingParamsError("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options",
                                      "stream_options is only allowed when stream is true")
        chosen = {name: getattr(self, name) for name in
                  ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        chosen |= {name: value for name, value in (defaults or {}).items()
                   if name in chosen and name not in self.model_fields_set}
        return SamplingParams(
            **chosen,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=tuple([self.stop] if isinstance(self.stop, str)
                                                   else self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            n=self.n, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


MaxTokens = Annotated[int, Field(ge=1, json_schema_extra=_served("max_tokens"))]

# What _no_empty_prompt and the engine's vocabulary check enforce, for /openapi.json.
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                         **_served("token_id")},
              **_served("max_tokens")}
_PROMPT = {"anyOf": [{"type": "string", "minLength": 1},
                     {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                      "items": {"type": "string", "minLength": 1}},
                     _TOKEN_IDS, {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                                  "items": _TOKEN_IDS}],
           "description": "Text, token ids, or a batch of either."}


class CompletionRequest(_Request):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(_PROMPT)]
    max_tokens: MaxTokens | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description=f"Top-N logprobs per token (N <= {MAX_LOGPROBS}).")
    echo: bool = False
    suffix: str | None = Field(None, description="Not supported (400 if set).",
                               json_schema_extra={"maxLength": 0})

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, prompt):
        prompts = _prompts(prompt)
        if not prompts or not all(prompts):
            raise ValueError("prompt is empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a (possibly batched) request."""
        return _prompts(self.prompt)

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        if self.suffix:
            raise SamplingParamsError("suffix", "suffix is not supported")
        return self.sampling_params(self.max_tokens, self.logprobs, defaults)


def _prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # tool_calls, ... reach the template. The schema asks every message for its content, as
    # templates do (a turn of tool calls, which the schema leaves undescribed, may go without).
    model_config = ConfigDict(extra="allow", json_schema_extra=_rules(
        _given("content"), _when(_given("role", {"const": "tool"}),
                                 _given("tool_call_id", {"type": "string", "minLength": 1}))))

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
    model_config = ConfigDict(json_schema_extra=_rules(_when(
        _given("type", {"const": "json_schema"}),
        _given("json_schema", {"required": ["schema"],
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
    _when(_given("top_logprobs"), _given("logprobs", {"const": True})),
    _when(_given("tool_choice", {"not": {"enum": ["none", None]}}),
          _given("tools", {"type": "array", "minItems": 1})),
    _when(_given("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]}),
          _NO_CONSTRAINT),
    _when(_given("response_format", _CONSTRAINS),
          {"properties": {"structured_outputs": {"type": "null"}}}),
)
# What chat_template_kwargs cannot override: the template's own arguments (the request's fields
# set them), the model's tokens (its files do) and the helpers transformers gives templates.
_TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token",
                       "raise_exception", "strftime_now")


class ChatCompletionRequest(_Request):
    model_config = ConfigDict(json_schema_extra=_rules(*_SAMPLING_RULES, *_CHAT_RULES))

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
    model_config = ConfigDict(json_schema_extra={"oneOf": [_given("prompt"), _given("messages")]})

    model: str | None = Field(None, json_schema_extra=_served("model"))
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = Field(None, json_schema_extra=_served("model"))
    tokens: list[TokenId]
