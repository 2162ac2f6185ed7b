"""Speculative decoding by prompt lookup (n-gram): the configuration, the proposer and when a
sequence drafts.

A sequence that drafts brings its last token and k proposed tokens to a step as one ragged
chunk; the head samples a token after each of those k + 1 positions, every row with the key
of the position it samples (seed, output index; ops.sampling_metadata.row_keys), so each row
draws exactly the token a plain decode would draw there. The scheduler keeps the drafts up to
the first one that differs from the token sampled before it, plus that sampled token
(`accept`), and rolls the rest back: its K/V positions are recomputed later, its pages freed,
and the prefix cache only ever holds computed, verified tokens (engine/scheduler.py).

For a draft without probabilities (one token, as prompt lookup proposes) this is rejection
sampling: the draft d is kept with probability p(d), the target's probability after every
filter, and a rejected position gets the target's token drawn from p without d, renormalised.
So the output distribution is the target's, greedy gives the target's greedy tokens, and a
seeded request gives the same tokens with or without speculation, alone or in any batch.

Drafting costs the step its overlap (the proposer needs the last token), so a sequence whose
drafts found nothing or were all rejected waits a while before it drafts again (`Drafter`),
and the scheduler drafts only while the batch is small (`max_seqs`).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

METHODS = ("ngram",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys for prompt lookup."""

    method: str = "ngram"
    num_speculative_tokens: int = 4   # k: tokens proposed per step
    prompt_lookup_max: int = 4        # longest suffix looked up in the sequence so far
    prompt_lookup_min: int = 1        # shortest
    # Sequences in a step up to which drafting runs (a larger batch is compute-bound already
    # and keeps its overlapped steps); None: max_num_seqs // (k + 1).
    max_seqs: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got "
                             f"{self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16], got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.max_seqs is not None and self.max_seqs < 1:
            raise ValueError(f"max_seqs must be positive, got {self.max_seqs}")

    @classmethod
    def parse(cls, text: str | dict | None) -> SpeculativeConfig | None:
        """From the flag's JSON (or a dict); None or '' is off."""
        if text is None or text == "":
            return None
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(text, dict):
            raise ValueError("--speculative-config must be a JSON object")
        if "model" in text:
            raise ValueError("--speculative-config: draft models are not supported yet; use "
                             '{"method": "ngram", "num_speculative_tokens": k}')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(text) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        for key, value in text.items():
            if key != "method" and value is not None and (
                    not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")
        return cls(**text)

    def seq_limit(self, max_num_seqs: int) -> int:
        """Running sequences up to which a step drafts."""
        if self.max_seqs is not None:
            return self.max_seqs
        return max(1, max_num_seqs // (self.num_speculative_tokens + 1))


def propose(token_ids: list[int] | np.ndarray, k: int, lookup_max: int,
            lookup_min: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the longest
    suffix (lookup_max down to lookup_min tokens) of `token_ids`; [] when none occurs."""
    ids = np.asarray(token_ids, np.int64)
    n_total = len(ids)
    for n in range(min(lookup_max, n_total - 1), lookup_min - 1, -1):
        suffix = ids[n_total - n:]
        windows = np.lib.stride_tricks.sliding_window_view(ids[:n_total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the token after the latest occurrence
            return ids[start:start + k].tolist()
    return []


@dataclasses.dataclass
class Drafter:
    """A sequence's drafting state: after a draft that proposed nothing or lost every token
    it waits `backoff` output tokens (doubling up to MAX_BACKOFF) before it drafts again."""

    MAX_BACKOFF = 32
    next_at: int = 0   # output index from which it may draft
    backoff: int = 1

    def ready(self, num_output_tokens: int) -> bool:
        return num_output_tokens >= self.next_at

    def record(self, num_output_tokens: int, proposed: int, accepted: int) -> None:
        if proposed and accepted:
            self.backoff = 1
            return
        self.next_at = num_output_tokens + self.backoff
        self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)


def accepted_length(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the step keeps: drafts[j] stands while it equals sampled[j], the token
    the target drew at its position."""
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return a


@dataclasses.dataclass
class SpecDecodeStats:
    """Counters for /metrics and the benchmarks (vLLM's spec_decode names)."""

    num_drafts: int = 0            # sequence-steps that brought drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        grow = proposed - len(self.accepted_per_position)
        if grow > 0:
            self.accepted_per_position.extend([0] * grow)
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting sequence gained per step: accepted drafts + the sampled one."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
