"""What a request hands back: RequestOutput / CompletionOutput, and the per-sequence
text state (incremental detokenization, stop strings, logprobs).

The engine's outputs are deltas (vLLM's `RequestOutputKind.DELTA`): each carries only what
is new since the request's previous output, so what waits on a slow consumer's stream grows
with the new tokens, not with every step's full copy. A consumer that wants the whole
result folds them with `accumulate`.
"""

from __future__ import annotations

import dataclasses

from models.detokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the N most likely tokens and their logprobs


@dataclasses.dataclass
class CompletionOutput:
    """One sequence's text, tokens and logprobs: new since its previous output (the engine's
    outputs) or all of them (`accumulate`'s). The stop string is never in the text."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None      # None while running; "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None  # one per token id; None when not requested

    def add(self, later: CompletionOutput) -> None:
        """Append a later output of the same sequence (logprobs only if this one keeps
        them)."""
        self.text += later.text
        self.token_ids += later.token_ids
        if self.logprobs is not None and later.logprobs:
            self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason

    @property
    def size(self) -> int:
        """Token ids and top logprobs held: what a stream's backlog is bounded by."""
        return len(self.token_ids) + sum(len(lp.top) for lp in self.logprobs or ())


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # every sequence of the request, by index
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None       # set when the engine failed the request

    def add(self, later: RequestOutput) -> None:
        """Fold a later delta of the same request into this output (in place)."""
        for mine, new in zip(self.outputs, later.outputs, strict=True):
            mine.add(new)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.error = later.error or self.error

    @property
    def size(self) -> int:
        return sum(c.size for c in self.outputs)


def accumulate(total: RequestOutput | None, delta: RequestOutput,
               logprobs: bool = True) -> RequestOutput:
    """`total` (None: nothing yet) with `delta` appended: the request's whole output so far.
    `logprobs=False` keeps none (a stream has sent them already). The deltas are not
    modified."""
    if total is None:
        total = RequestOutput(delta.request_id, delta.prompt_token_ids, [
            CompletionOutput(c.index, "", [], None,
                             [] if logprobs and c.logprobs is not None else None)
            for c in delta.outputs], False)
    total.add(delta)
    return total


class TextState:
    """One sequence's output text. Text that might be the start of a stop string is held
    back until it cannot be, so a stop string never leaks into streamed output. Tokens and
    logprobs are kept only until `take` hands them out."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...],
                 skip_special_tokens: bool):
        # tokenizer None: token ids only (benchmarks of random-weight models have no vocabulary)
        self.detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""       # everything decoded (up to a stop string, once found)
        self.emitted = 0     # chars of `text` already handed out as deltas
        self.new_token_ids: list[int] = []           # read, not handed out yet
        self.new_logprobs: list[TokenLogprob] = []   # theirs, when requested

    def add(self, token_id: int, logprob: TokenLogprob | None = None) -> bool:
        """Append a token; returns True when a stop string has been reached."""
        self.new_token_ids.append(token_id)
        if logprob is not None:
            self.new_logprobs.append(logprob)
        return self._extend(self.detok.add(token_id)) if self.detok else False

    def finish(self) -> bool:
        """The sequence ended: release text the detokenizer still held."""
        return self._extend(self.detok.flush()) if self.detok else False

    def _extend(self, new: str) -> bool:
        before = len(self.text)
        self.text += new
        if self.stop and new:
            start = max(0, before - self.holdback)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stop = ()  # found: nothing after it is ever added
                return True
        return False

    def delta(self, finished: bool) -> str:
        end = len(self.text) if finished or not self.stop else max(
            self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def take(self) -> tuple[list[int], list[TokenLogprob]]:
        """The tokens (and their logprobs) read since the last call."""
        out = self.new_token_ids, self.new_logprobs
        self.new_token_ids, self.new_logprobs = [], []
        return out
