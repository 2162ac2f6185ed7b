"""Speculative decoding: the configuration, prompt lookup (n-gram) and when a sequence
drafts; a draft model's drafts are drawn by engine/draft_model.py into the positions the
scheduler books for them, and verified here the same way.

A sequence that drafts brings its last token and k proposed tokens to a step as one ragged
chunk; the head samples a token after each of those k + 1 positions, every row with the
uniform of the position it samples (seed, output index; ops.sampling_metadata.row_uniforms),
so each row draws exactly the token a plain decode would draw there. The scheduler keeps the
drafts up to the first one that differs from the token sampled before it, plus that sampled
token (`accept`), and rolls the rest back: its K/V positions are recomputed later, its pages
freed, and the prefix cache only ever holds computed, verified tokens (engine/drafting.py,
engine/scheduler.py).

A draft model given prompt_lookup_max or _min drafts only where prompt lookup finds nothing:
a step takes the lookup's drafts where there are some (they cost no drafting rounds), the
model's otherwise, and a lookup that lost costs no waiting (each kind keeps its own
acceptance in the sequence's `Drafter`). Both are verified the same way. The model's K/V
falls behind while lookup drafts, and its next drawing first writes the tokens since: its
drafts pay for that too (`StepCosts.catch_up`, spread over the tokens since lookup last
drafted), so a sequence between two matches of the text it repeats takes a plain step.

For a draft without probabilities (one token, as prompt lookup proposes) this is rejection
sampling: the draft d is kept with probability p(d), the target's probability after every
filter, and a rejected position gets the target's token drawn from p without d, renormalised.
So the output distribution is the target's, greedy gives the target's greedy tokens, and a
seeded request gives the same tokens with or without speculation, alone or in any batch.

How many drafts pay is engine/draft_costs.py's cost model. A sequence whose drafts found
nothing or lost every token waits a while before it drafts again, and the scheduler drafts
only while the batch is small (`max_seqs`). A drafting step gives up the overlap with the
step before it, so prompt lookup is tried only where a match can follow the token in flight
(`may_match`, checked while it is sampled).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys for prompt lookup and for a draft model."""

    method: str = "ngram"
    num_speculative_tokens: int = 4   # k: tokens proposed per step
    # draft_model: a smaller model of the target's vocabulary (a path or a known model's
    # name; engine/draft_model.py). Given alone, it sets the method, as in vLLM.
    model: str | None = None
    # Longest and shortest suffix looked up in the sequence so far. Drafts after a suffix of
    # 3 or more are kept more often (docs/serving.md); unset, the longest is 8 and the
    # shortest min(3, prompt_lookup_max). Given with a model, prompt lookup drafts first and
    # the model only where it finds nothing (`looks_up`).
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # Sequences in a step up to which drafting runs (a larger batch is compute-bound already
    # and keeps its overlapped steps); None: max_num_seqs // (k + 1).
    max_seqs: int | None = None

    def __post_init__(self):
        if self.prompt_lookup_max is None and (self.method == "ngram"
                                               or self.prompt_lookup_min is not None):
            object.__setattr__(self, "prompt_lookup_max", max(8, self.prompt_lookup_min or 0))
        if self.prompt_lookup_min is None and self.prompt_lookup_max is not None:
            object.__setattr__(self, "prompt_lookup_min", min(3, self.prompt_lookup_max))
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got "
                             f"{self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16], got "
                             f"{self.num_speculative_tokens}")
        if self.looks_up and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.max_seqs is not None and self.max_seqs < 1:
            raise ValueError(f"max_seqs must be positive, got {self.max_seqs}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('--speculative-config: a draft model is {"model": PATH_OR_NAME, '
                             '"num_speculative_tokens": k}; prompt lookup takes no model')

    @property
    def looks_up(self) -> bool:
        """Whether drafts come from prompt lookup: always for "ngram"; for a draft model, where
        prompt_lookup_max or _min is given (lookup first, the model where it finds nothing)."""
        return self.prompt_lookup_max is not None

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
        if "model" in text and "method" not in text:
            text = {**text, "method": "draft_model"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(text) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        for key, value in text.items():
            if key in ("method", "model"):
                if not isinstance(value, str) or not value:
                    raise ValueError(f"--speculative-config: {key} must be a non-empty string, "
                                     f"got {value!r}")
            elif value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")
        return cls(**text)

    def seq_limit(self, max_num_seqs: int) -> int:
        """Running sequences up to which a step drafts."""
        if self.max_seqs is not None:
            return self.max_seqs
        return max(1, max_num_seqs // (self.num_speculative_tokens + 1))


def _as_list(token_ids: list[int] | np.ndarray) -> list[int]:
    """The ids as a list, without a copy when they are one (read only here)."""
    return token_ids if isinstance(token_ids, list) else np.asarray(token_ids).tolist()


def _longest_earlier_match(ids: list[int], longest: int) -> tuple[int, int]:
    """(n, j): the most tokens n (at most `longest`, <= len(ids) - 1) up to an earlier
    position j (j < len(ids) - 1) equal to the last n tokens, j the latest such position;
    (0, -1) when the last token occurs nowhere earlier. Found from the last token's earlier
    positions (list.index, a scan in C), each extended back while it still matches, the
    latest first: a 700-token sequence takes ~10-20 us, where a pass over the sequence per
    suffix length took ~0.1-0.6 ms."""
    last = len(ids) - 1
    token, positions, j = ids[last], [], -1
    try:
        while True:
            j = ids.index(token, j + 1, last)
            positions.append(j)
    except ValueError:
        pass
    best, at = 0, -1
    for j in reversed(positions):
        n = 1
        while n < longest and n <= j and ids[j - n] == ids[last - n]:
            n += 1
        if n > best:
            best, at = n, j
            if n == longest:
                break
    return best, at


def propose(token_ids: list[int] | np.ndarray, k: int, lookup_max: int,
            lookup_min: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the longest
    suffix (lookup_max down to lookup_min tokens) of `token_ids`; [] when none occurs."""
    ids = _as_list(token_ids)
    longest = min(lookup_max, len(ids) - 1)
    if longest < lookup_min:
        return []
    n, j = _longest_earlier_match(ids, longest)
    return ids[j + 1:j + 1 + k] if n >= lookup_min else []


def may_match(token_ids: list[int] | np.ndarray, lookup_min: int) -> bool:
    """Whether prompt lookup can find a match once the token after `token_ids` is known (the
    one a step in flight samples): a suffix of at least `lookup_min` tokens ending with it
    occurs earlier only if the last lookup_min - 1 tokens of `token_ids` occur earlier with a
    token after them. Checked while that step runs, so that a sequence outside any repeated
    text keeps its steps overlapped instead of waiting for a token to look up nothing."""
    n = lookup_min - 1
    ids = _as_list(token_ids)
    if n <= 0:
        return len(ids) > 0
    if len(ids) <= n:
        return False
    return _longest_earlier_match(ids, n)[0] >= n


def kept_average(acceptance: float, rate: float, proposed: int, accepted: int) -> float:
    """A moving average of how often a draft position is kept, after a step that verified
    `proposed` drafts and kept `accepted`: the kept positions, then the first lost one."""
    for kept in [1.0] * accepted + [0.0] * (accepted < proposed):
        acceptance += rate * (kept - acceptance)
    return acceptance


@dataclasses.dataclass
class Drafter:
    """A sequence's drafting state: how often a draft position was kept (`acceptance`, a
    moving average over the positions verified), and after a draft that proposed nothing or
    lost every token, `backoff` output tokens (doubling up to MAX_BACKOFF) of waiting."""

    MAX_BACKOFF = 32
    RATE = 0.2         # weight of each verified position in the moving average
    next_at: int = 0   # output index from which it may draft
    backoff: int = 1
    acceptance: float = 0.7  # before any evidence: prompt lookup's usual rate on edits
    # A draft model that looks up first: how often prompt lookup's drafts are kept (those of
    # the model are `acceptance`). A lookup that finds nothing or loses costs no waiting: the
    # model drafts next.
    lookup_acceptance: float = 0.7
    looked_up_at: int = 0  # beside a draft model: the output index prompt lookup last drafted at

    def ready(self, num_output_tokens: int) -> bool:
        return num_output_tokens >= self.next_at

    probing: bool = False    # after stepping aside: the next draft goes in full, to learn

    def record_lookup(self, proposed: int, accepted: int) -> None:
        self.lookup_acceptance = kept_average(self.lookup_acceptance, self.RATE, proposed,
                                              accepted)

    def record(self, num_output_tokens: int, proposed: int, accepted: int) -> None:
        self.acceptance = kept_average(self.acceptance, self.RATE, proposed, accepted)
        if proposed:
            self.probing = False
        if proposed and accepted:
            self.backoff = 1
            return
        self.wait(num_output_tokens)

    def step_aside(self, num_output_tokens: int) -> None:
        """Drafts did not pay now: wait, then probe with a full draft."""
        self.wait(num_output_tokens)
        self.probing = True

    def wait(self, num_output_tokens: int) -> None:
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
    # How often a draft position was kept lately, over every sequence (a moving average, as
    # a Drafter's but slower): where a new sequence's drafter starts, so that a workload whose
    # drafts are kept drafts in full from a request's first step.
    recent_acceptance: float = Drafter.acceptance

    RATE = 0.05

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.recent_acceptance = kept_average(self.recent_acceptance, self.RATE, proposed,
                                              accepted)
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


def fit_drafts(scheduled, num_drafts: int, token_buckets, blocks) -> None:
    """Drafts never make a step pay for padding: when they carry the step's tokens (the
    scheduler's entries) past a bucket, the last drafts go (the longest drafts lose theirs
    first) until the tokens fill that bucket exactly, and the pages they held are freed. (One
    sequence drafting 4 runs 4 tokens, not 5 padded to 8: a token's rows cost about the same
    whether they hold a draft or padding.)"""
    total = sum(e.num_new_tokens for e in scheduled)
    below = max(b for b in token_buckets if b <= total)
    excess = total - below
    if excess == 0 or excess > num_drafts:  # no bucket boundary within the drafts' reach
        return
    drafting = [e for e in scheduled if e.drafts]
    for _ in range(excess):
        entry = max(drafting, key=lambda e: len(e.drafts))
        entry.drafts.pop()
        entry.num_new_tokens -= 1
        entry.seq.token_ids.pop()
    for entry in drafting:
        blocks.trim(entry.seq)


def drop_drafts(entry, n: int, blocks) -> None:
    """Take the last n drafts out of a booked step (the scheduler's entry; a grammar forbids
    them): their positions and pages go; the token to sample stays last."""
    if n <= 0:
        return
    seq = entry.seq
    del seq.token_ids[entry.end - n:entry.end]
    del entry.drafts[-n:]
    entry.num_new_tokens -= n
    seq.num_computed_tokens -= n
    blocks.trim(seq)
