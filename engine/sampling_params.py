"""SamplingParams: how one request is decoded, validated at construction.

Field names and meanings follow vLLM/OpenAI. An out-of-range value raises
`SamplingParamsError`, whose `param` names the field, so the server can answer
400 with the OpenAI error shape.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping

import numpy as np

MAX_LOGPROBS = 20
MAX_N = 128  # choices per prompt: OpenAI's limit (the extra sequences wait for a free slot)
# logit_bias entries per request: OpenAI's documented limit (its legacy docs: "up to 300"),
# so a client written against OpenAI is not refused here. Each step's sampling buffers carry
# this many (id, bias) columns per row (engine/batch.py), about 2.4 KiB a row; rows without a
# bias cost the sampler nothing (ops/sampling.py).
MAX_LOGIT_BIAS = 300
MAX_BIAS = 100.0  # |bias|: -100 bans the token, +100 makes it the only choice (see below)
_TOKEN_KEY = re.compile(r"0|[1-9][0-9]*")  # a token id as a JSON object key (OpenAI's form)
# The step buffers' dtypes (engine/batch.py): a request's integers (top_k, min_tokens, stop
# token ids, token counts) sit in int32 columns and its floats in float32 ones. The bounds
# below, and the server's request models (server/protocol.py), derive from them, so no value
# that passes validation overflows a column on the engine thread.
INT_DTYPE = np.int32
FLOAT_DTYPE = np.float32
INT_MAX = int(np.iinfo(INT_DTYPE).max)


class SamplingParamsError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """The grammar a request's output must follow (vLLM's `structured_outputs`): exactly one
    of a JSON schema (as JSON text), any JSON object, a regular expression, one of the
    `choice` strings, or a grammar (Lark, or llama.cpp's GBNF). engine/grammar.py compiles it."""

    json: str | None = None         # a JSON schema, serialized
    json_object: bool = False       # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None      # Lark (llguidance's dialect) or GBNF

    def __post_init__(self):
        if self.json is not None and not isinstance(self.json, str):  # a schema given as a dict
            object.__setattr__(self, "json", json.dumps(self.json))  # (keys in the given order)
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs", "structured_outputs needs exactly "
                                      f"one of json, json_object, regex, choice, grammar; got "
                                      f"{', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("structured_outputs",
                                      "choice must be a non-empty list of non-empty strings")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # (0, 1]
    top_k: int = 0                    # 0 or -1 = off
    min_p: float = 0.0                # [0, 1]
    presence_penalty: float = 0.0     # [-2, 2]
    frequency_penalty: float = 0.0    # [-2, 2]
    repetition_penalty: float = 1.0   # > 0; 1 = off
    seed: int | None = None
    max_tokens: int | None = 16       # None = up to the context limit
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None       # top-N logprobs per token, N <= 20
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: (token id, bias) pairs sorted by id, from a dict {id: bias} (ids as
    # ints, or as the decimal strings of a JSON object's keys). A bias in (-100, 100) is added
    # to the token's logit before penalties and temperature (vLLM's order); -100 bans the
    # token (it is never drawn) and +100 makes it exclusive (only +100 tokens can be drawn,
    # weighted by their logits), which OpenAI describes as what those values "should result
    # in". Ids are checked against the vocabulary when the engine takes the request.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        # Accept lists/str from JSON and normalise to tuples (the dataclass is frozen/hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                   for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids: token ids must be "
                                      "integers")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        self._validate()

    def _validate(self):
        def bad(param, message):
            raise SamplingParamsError(param, f"{param}: {message}")

        for name in ("top_k", "min_tokens", "n", "max_tokens", "logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer))
                                      or isinstance(value, bool)):
                bad(name, f"must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                bad(name, f"must be a number, got {value!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= INT_MAX:
            bad("top_k", f"must be -1, 0 (off) or in [1, {INT_MAX}], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad("seed", f"must be in [0, 2^63), got {self.seed}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= INT_MAX:
            bad("max_tokens", f"must be in [1, {INT_MAX}], got {self.max_tokens}")
        if not 0 <= self.min_tokens <= INT_MAX:
            bad("min_tokens", f"must be in [0, {INT_MAX}], got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens "
                              f"({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if len(self.stop) > 16:
            bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if any(not 0 <= t <= INT_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", f"token ids must be in [0, {INT_MAX}]")
        if len(self.stop_token_ids) > 12:  # with up to 4 EOS ids: the sampler's ban list (16)
            bad("stop_token_ids", f"at most 12 stop token ids, got {len(self.stop_token_ids)}")
        if not 1 <= self.n <= MAX_N:
            bad("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _logit_bias(given) -> tuple[tuple[int, float], ...]:
    """`SamplingParams.logit_bias` normalised: a dict or pairs -> (id, bias) pairs sorted by
    id, each checked (the vocabulary aside: LLMEngine.check_logit_bias)."""
    def bad(message):
        raise SamplingParamsError("logit_bias", f"logit_bias: {message}")

    if given is None:
        return ()
    if isinstance(given, Mapping):
        items = list(given.items())
    elif isinstance(given, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in given):
        items = [tuple(p) for p in given]
    else:
        bad(f"must map token ids to biases, got {given!r}")
    if len(items) > MAX_LOGIT_BIAS:
        bad(f"at most {MAX_LOGIT_BIAS} entries, got {len(items)}")
    pairs = {}
    for key, bias in items:
        if isinstance(key, str) and _TOKEN_KEY.fullmatch(key):
            key = int(key)
        if not isinstance(key, (int, np.integer)) or isinstance(key, bool):
            bad(f"keys must be token ids (integers), got {key!r}")
        if not 0 <= key <= INT_MAX:
            bad(f"token id {key} is outside [0, {INT_MAX}]")
        if int(key) in pairs:
            bad(f"token id {key} is given twice")
        if (isinstance(bias, bool) or not isinstance(bias, (int, float, np.number))
                or not math.isfinite(bias) or not -MAX_BIAS <= bias <= MAX_BIAS):
            bad(f"the bias of token {key} must be a number in [-100, 100], got {bias!r}")
        # As the sampler's float32 column holds it; only an exact +-100 bans or forces.
        held = np.float32(bias)
        if abs(held) == MAX_BIAS and abs(bias) != MAX_BIAS:
            held = np.nextafter(held, np.float32(0))
        pairs[int(key)] = float(held)
    return tuple(sorted(pairs.items()))
