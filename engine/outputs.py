"""What a request hands back: RequestOutput / CompletionOutput, and the per-sequence
text state (incremental detokenization, stop strings, logprobs)."""

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
    index: int
    text: str                      # all text so far (stop string excluded)
    token_ids: list[int]
    finish_reason: str | None      # None while running; "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None
    delta: str = ""                # text new since the previous output of this sequence
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None       # set when the engine failed the request


class TextState:
    """One sequence's output text. Text that might be the start of a stop string is held
    back until it cannot be, so a stop string never leaks into streamed output."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...],
                 skip_special_tokens: bool):
        # tokenizer None: token ids only (benchmarks of random-weight models have no vocabulary)
        self.detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""       # everything decoded (up to a stop string, once found)
        self.emitted = 0     # chars of `text` already handed out as deltas
        self.logprobs: list[TokenLogprob] = []
        self.token_ids: list[int] = []
        self.sent_tokens = 0

    def add(self, token_id: int) -> bool:
        """Append a token; returns True when a stop string has been reached."""
        self.token_ids.append(token_id)
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

    def delta_tokens(self) -> list[int]:
        out = self.token_ids[self.sent_tokens:]
        self.sent_tokens = len(self.token_ids)
        return out
