"""Structured output: a request's grammar compiled with llguidance, and each step's token mask.

A request with `structured_outputs` (engine/sampling_params.py) gets one llguidance matcher
per sequence. Before the sampler runs, the matchers of the step's constrained rows write
which tokens may come next into a packed bitmask, int32 [S, ceil(V / 32)] (bit i % 32 of
word i // 32 is token i), which the compiled step applies to those rows only (the
`constrained` column); the engine computes it while the device runs the model body. Each
sampled token then advances its sequence's matcher. The end-of-sequence tokens are allowed
exactly when the grammar may end there; once nothing but the end may follow, the sequence
stops.

Compiling is the costly part and runs once per distinct grammar: `Grammars.compile` keeps an
LRU cache of compiled matchers, bounds the work with llguidance's parser limits, and raises
`GrammarError` (the request's 400) for a grammar that does not compile or is too costly. The
server calls it off the event loop, with a time limit, before the request is queued.
"""

from __future__ import annotations

import collections
import threading
import time

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

from engine.sampling_params import SamplingParamsError, StructuredOutputsParams
from models.tokenizer import Tokenizer

# What one grammar may cost: llguidance's own limits ("fuel", in work units) bound building
# and stepping it, which turns a pathological schema into an error after ~1 s of work rather
# than a stuck worker (on the 2-core CPU, an enum of 100,000 values: "initial lexer
# configuration (grammar) too big" after 0.2 s, of 1,000,000 after 2.7 s; 30,000 properties:
# "schema too large" at once). The server adds a wall-clock limit on top (COMPILE_TIMEOUT_S).
LIMITS = dict(verbose_errors=False)
COMPILE_TIMEOUT_S = 10.0
# How constrained JSON is laid out: on one line, with a space after ',' and ':' (as models
# write it; OpenAI's replies look the same). Free whitespace let small models loop on newlines
# and indentation until max_tokens (vLLM offers to turn it off for the same reason).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 128


class GrammarError(SamplingParamsError):
    """The grammar does not compile, or costs more than the limits allow."""

    def __init__(self, message: str, param: str = "structured_outputs"):
        super().__init__(param, message)


def mask_words(vocab_size: int) -> int:
    """int32 words per row of the token mask."""
    return (vocab_size + 31) // 32


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a request's `structured_outputs`."""
    try:
        if spec.json is not None or spec.json_object:
            return llg.LLMatcher.grammar_from_json_schema(
                spec.json if spec.json is not None else '{"type": "object"}', defaults=JSON_LAYOUT)
        if spec.regex is not None:
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llg.grammar_from("choice", list(spec.choice))
        return llg.grammar_from("grammar", spec.grammar)  # Lark or GBNF
    except ValueError as e:
        raise GrammarError(f"invalid structured output: {e}") from None


class Grammars:
    """One model's grammar compiler, matcher cache and mask filler (thread-safe: the server
    compiles off the event loop while the engine thread steps)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._cache: collections.OrderedDict[StructuredOutputsParams, llg.LLMatcher] = (
            collections.OrderedDict())
        self._executor = None
        self.mask_seconds = 0.0  # host time spent filling masks, and the steps that did (bench)
        self.mask_steps = 0

    def _tokenizer(self) -> llg.LLTokenizer:
        with self._lock:  # built once, on first use (~0.2 s for a 49k vocabulary)
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _ll_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> llg.LLMatcher:
        """`spec`'s compiled matcher at its start, from the cache or compiled into it (never
        stepped: `matcher` hands out copies); GrammarError when it cannot be had."""
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template
        template = llg.LLMatcher(self._tokenizer(), grammar_text(spec), log_level=0,
                                 limits=llg.LLParserLimits(**LIMITS))
        if template.is_error():
            raise GrammarError(f"invalid structured output: {template.get_error()}")
        with self._lock:
            self._cache[spec] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def matcher(self, spec: StructuredOutputsParams) -> llg.LLMatcher:
        """A fresh matcher for one sequence following `spec`."""
        return self.compile(spec).deep_copy()

    def fill_mask(self, rows: list[tuple[int, llg.LLMatcher, list[int]]],
                  num_rows: int) -> np.ndarray:
        """[num_rows, mask_words(V)] int32: each (row, matcher, drafts)'s allowed next tokens
        at its row, and with drafts (speculative decoding) after each of them at the rows
        that follow (the matcher is left as it was); other rows all zero (the step ignores
        them)."""
        start = time.perf_counter()
        mask = np.zeros((num_rows, mask_words(self.vocab_size)), np.int32)
        plain = [(m, r) for r, m, drafts in rows if not drafts]
        if len(plain) == 1:
            llg_np.fill_next_token_bitmask(plain[0][0], mask, plain[0][1])
        elif plain:
            if self._executor is None:
                self._executor = llg.LLExecutor()
            llg_np.fill_next_token_bitmask_par(self._executor, plain, mask)
        for row, matcher, drafts in rows:
            if drafts:
                fed = 0
                for j in range(len(drafts) + 1):
                    llg_np.fill_next_token_bitmask(matcher, mask, row + j)
                    if j == fed < len(drafts):
                        fed += feed(matcher, drafts[j:j + 1])
                matcher.rollback(fed)
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        return mask


def fill_mask_after(grammars: Grammars, rows: list[tuple[int, llg.LLMatcher, list[int]]],
                    num_rows: int) -> np.ndarray:
    """Like Grammars.fill_mask, but each (row, matcher, drafts) fills only its row, with the
    tokens its matcher allows after `drafts` (a draft model drawing the next draft)."""
    mask = np.zeros((num_rows, mask_words(grammars.vocab_size)), np.int32)
    for row, matcher, drafts in rows:
        fed = feed(matcher, drafts)
        llg_np.fill_next_token_bitmask(matcher, mask, row)
        matcher.rollback(fed)
    return mask


def feed(matcher: llg.LLMatcher, tokens: list[int]) -> int:
    """Consume the tokens the grammar allows in a row, up to its end (where the matcher stops:
    the end-of-sequence token after it would not roll back); returns how many, for the
    caller's `rollback`. A forbidden token is never fed (it would leave the matcher in error)."""
    fed = 0
    for token in tokens[:matcher.validate_tokens(tokens)]:
        if matcher.is_stopped():
            break
        matcher.consume_token(token)
        fed += 1
    return fed


def allowed_drafts(matcher: llg.LLMatcher, drafts: list[int]) -> int:
    """How many of `drafts` the grammar allows in a row from the matcher's state (which it
    leaves as it was)."""
    return matcher.validate_tokens(drafts)


def advance(matcher: llg.LLMatcher, token: int) -> bool:
    """Feed a sampled token; True when the output must end here (nothing but the end of the
    sequence may follow, or the token broke the grammar, which the mask should prevent)."""
    return not matcher.consume_token(token) or matcher.is_stopped()


def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llg.LLTokenizer:
    eos = sorted(tokenizer.eos_token_ids)
    hf_json = tokenizer.hf_json()
    if hf_json is not None:
        return llg.LLTokenizer(hf_json, n_vocab=vocab_size, eos_token=eos)
    return llg.LLTokenizer(llg.TokenizerWrapper(_Pieces(tokenizer, eos)), n_vocab=vocab_size,
                           eos_token=eos)


class _Pieces:
    """What llguidance's TokenizerWrapper reads from a tokenizer without a `tokenizers` JSON
    (sentencepiece): each token's bytes, the special ids, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, eos: list[int]):
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)
