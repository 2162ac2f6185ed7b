"""Request bodies of the OpenAI API (plus the usual engine extensions) as pydantic models:
the sampling fields every generation request shares and their mapping to `SamplingParams`,
the completions and detokenize bodies, and the schema helpers (server/chat_protocol.py has
the bodies that carry chat messages).

Unknown fields are ignored, as OpenAI clients send fields that change nothing here
(`user`, `store`, `metadata`, ...). Fields we cannot honour are refused with a 400
naming them, never silently dropped. The same models generate /openapi.json: every range,
length and enum a field is validated against is in its schema, and so are the rules that tie
fields together (JSON Schema `if`/`then` beside the validator that enforces them). A request
that follows the schema is refused only for what JSON Schema cannot say: its prompt's length
in tokens, a grammar that does not compile, fields compared with each other (min_tokens and
max_tokens, n times the number of prompts, unique tool names, the tool a tool_choice names).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from engine.sampling_params import (
    INT_MAX,
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)

MAX_PROMPTS = 256    # prompts in one completions request (each runs n sequences)
# Sequences in one completions request (n x prompts): each holds its own copy of its prompt, so
# this keeps what one request body can make the engine hold where it was when n stopped at 16.
MAX_CHOICES = 16 * MAX_PROMPTS
# The fields a served model's sampling defaults may set (models/generation_config.FIELDS,
# which server/ may not import: keep the two equal).
MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# Fields whose bounds depend on the served models carry an "x-served" mark that
# server/openapi.py replaces with those bounds: the served model names, a token id below the
# vocabulary size, at most max_model_len - 1 tokens (a prompt needs one).
def served(what: str) -> dict:
    return {"x-served": what}


TokenId = Annotated[int, Field(ge=0, json_schema_extra=served("token_id"))]
StopString = Annotated[str, Field(min_length=1)]


def rules(*conditions: dict):
    """json_schema_extra adding rules across fields (enforced by the model's validators)."""
    def extra(schema: dict) -> None:
        schema.setdefault("allOf", []).extend(conditions)
    return extra


def given(field: str, schema: dict | None = None) -> dict:
    """The JSON Schema condition 'field is present and matches schema (default: not null)'."""
    return {"required": [field],
            "properties": {field: schema if schema is not None else {"not": {"type": "null"}}}}


def when(condition: dict, then: dict) -> dict:
    return {"if": condition, "then": then}


class StreamOptions(BaseModel):
    include_usage: bool = False


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one of these."""

    # (SamplingParams checks that exactly one is given.)
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        given("json"), given("json_object", {"const": True}), given("regex"),
        given("choice"), given("grammar")]})

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


# A rule every generation request follows (checked in SamplingRequest.sampling_params).
SAMPLING_RULES = (when(given("stream_options"), given("stream", {"const": True})),)
# OpenAI's logit_bias: token ids as the keys of a JSON object (decimal, no sign or leading
# zero; server/openapi.py narrows the pattern to the served vocabulary). SamplingParams
# checks what this says, and the engine the vocabulary.
_LOGIT_BIAS = {
    "anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS,
               "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$", **served("token_key")},
               "additionalProperties": {"type": "number", "minimum": -MAX_BIAS,
                                        "maximum": MAX_BIAS}},
              {"type": "null"}],
    "description": f"Token id -> bias in [-100, 100] (at most {MAX_LOGIT_BIAS} ids), added to "
                   "the token's logit before penalties and temperature; -100 bans the token, "
                   "100 makes it the only choice (with other 100s)."}
LogitBias = Annotated[dict[str, float] | None, WithJsonSchema(_LOGIT_BIAS)]
# best_of must equal n, which JSON Schema can only say with a branch per value of n; schema
# generators (schemathesis) then take several times longer per request, so the schema asks
# for null and the description says the rest.
_BEST_OF = {"type": "null", "description": "Only best_of == n is supported (and changes nothing)."}


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=rules(*SAMPLING_RULES))

    model: str | None = Field(None, description="Served model name; optional with one model.",
                              json_schema_extra=served("model"))
    n: int = Field(1, ge=1, le=MAX_N, description="Choices per prompt.")
    best_of: Annotated[int | None, WithJsonSchema(_BEST_OF)] = None
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias = None
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
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options",
                                      "stream_options is only allowed when stream is true")
        chosen = {name: getattr(self, name) for name in MODEL_DEFAULTS}
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
            structured_outputs=self.structured(), logit_bias=self.logit_bias)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


MaxTokens = Annotated[int, Field(ge=1, json_schema_extra=served("max_tokens"))]

# What check_batch and the engine's vocabulary check enforce, for /openapi.json.
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                         **served("token_id")},
              **served("max_tokens")}


def batch_schema(most: int, description: str) -> dict:
    """The schema of a text, texts, token ids, or lists of token ids (at most `most`): a
    completions prompt, an embeddings input."""
    return {"anyOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "minItems": 1, "maxItems": most,
                       "items": {"type": "string", "minLength": 1}},
                      _TOKEN_IDS, {"type": "array", "minItems": 1, "maxItems": most,
                                   "items": _TOKEN_IDS}],
            "description": description}


def as_batch(value: str | list) -> list[str | list[int]]:
    """The items of a value `batch_schema` describes: one text or one list of ids is one."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


def check_batch(value, most: int, name: str):
    """`value` (see batch_schema), or ValueError when it or an item is empty or it holds more
    than `most` items."""
    items = as_batch(value)
    if not items or not all(items):
        raise ValueError(f"{name} is empty")
    if len(items) > most:
        raise ValueError(f"at most {most} {name}s in one request, got {len(items)}")
    return value


_PROMPT = batch_schema(MAX_PROMPTS, "Text, token ids, or a batch of either.")


class CompletionRequest(SamplingRequest):
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
        return check_batch(prompt, MAX_PROMPTS, "prompt")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a (possibly batched) request."""
        return as_batch(self.prompt)

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        if self.suffix:
            raise SamplingParamsError("suffix", "suffix is not supported")
        if self.n * len(self.prompts()) > MAX_CHOICES:
            raise SamplingParamsError("n", f"n ({self.n}) times the prompts "
                                      f"({len(self.prompts())}) must be at most {MAX_CHOICES}")
        return self.sampling_params(self.max_tokens, self.logprobs, defaults)


class DetokenizeRequest(BaseModel):
    model: str | None = Field(None, json_schema_extra=served("model"))
    tokens: list[TokenId]
