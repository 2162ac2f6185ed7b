"""Speculative decoding's cost model: how many drafts a decode brings to a step.

Drafting pays only where a step of more tokens costs little more than a step of one: on a
GPU at a few sequences, hardly at all on a small CPU, where each token's rows are compute.
So the scheduler drafts k tokens only when the step's expected tokens per second grow by it
(`choose_drafts`): the expected tokens come from the sequence's acceptance so far (`Drafter`,
each draft position kept with probability a: 1 + a + ... + a^k tokens), the seconds from
what steps of each token bucket took (`StepCosts`: timed at warmup on padding, then each step
that ran, from the previous step's result to its own, so the host's share, the overlap a
drafting step gives up (the proposer needs the last token) and the sequences' context are
all in it). What drafts cost beyond the step (a draft model's rounds and its catching up)
the caller says: `Drafting.pays` (engine/drafting.py).
"""

from __future__ import annotations


class StepCosts:
    """Seconds a step of each token bucket takes: timed once at warmup (the runner's
    `step_seconds`, on padding), then a moving average of the steps that ran, each from the
    previous step's result to its own while the engine is busy (LLMEngine._read): a step that
    overlapped the host's work costs its device time, one that waited for the token before it
    (drafting) costs the host's share too. With a draft model, also what one of its drafting
    rounds takes (`draft_round`: a token for each drafting sequence), k rounds for k drafts,
    counted apart from the step."""

    RATE = 0.1

    def __init__(self, seconds: dict[int, float] | None = None):
        self.seconds = seconds if seconds is not None else {}  # (the runner's, filled at warmup)
        self.draft_round: float | None = None
        # A draft model beside prompt lookup: what its step over T tokens of one sequence (one
        # head row) takes, timed at warmup on padding: a first round that writes the K/V of the
        # tokens that prompt lookup's steps brought since the model last drew.
        self.draft_steps: dict[int, float] = {}

    def _average(self, old: float | None, seconds: float) -> float:
        return seconds if old is None else old + self.RATE * (seconds - old)

    def record_round(self, seconds: float) -> None:
        self.draft_round = self._average(self.draft_round, seconds)

    def record(self, bucket: int, seconds: float) -> None:
        self.seconds[bucket] = self._average(self.seconds.get(bucket), seconds)

    def of(self, bucket: int) -> float | None:
        return self.seconds.get(bucket)

    def catch_up(self, behind: int, bucket_of) -> float:
        """What a draft model's first round costs beyond a usual one (a token or two) when it
        brings `behind` tokens (past the timed buckets: in proportion to the largest)."""
        if not self.draft_steps or behind <= 2:
            return 0.0
        usual = self.draft_steps.get(bucket_of(2), 0.0)
        largest = max(self.draft_steps)
        if behind > largest:
            return self.draft_steps[largest] * behind / largest - usual
        return max(0.0, self.draft_steps.get(bucket_of(behind), usual) - usual)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a sequence gains from a step with k drafts: the sampled one, and draft j kept
    with probability acceptance^j (each kept only if the ones before it were)."""
    return 1 + sum(acceptance ** j for j in range(1, k + 1))


def choose_drafts(acceptance: float, room: int, tokens: int, gain: float, bucket_of,
                  costs: StepCosts, per_draft: float = 0.0, fixed: float = 0.0) -> int:
    """How many drafts (0 .. room) a decode should bring to a step that holds `tokens` tokens
    and an expected `gain` tokens before it: the most expected tokens per second for the
    whole step. A bucket not timed yet counts as costing what the step costs without drafts
    (so it is tried, and timed). What drafts cost beyond the step counts too: `per_draft`
    seconds each (a draft model's rounds; prompt lookup's cost nothing to find) and `fixed`
    seconds for any at all (a draft model's K/V to catch up)."""
    base = costs.of(bucket_of(tokens + 1))
    best, best_rate = 0, None
    for k in range(room + 1):
        cost = costs.of(bucket_of(tokens + 1 + k)) or base
        if cost is None:  # nothing timed at all: draft in full
            return room
        if k:
            cost += k * per_draft + fixed
        rate = (gain + expected_tokens(acceptance, k)) / cost
        if best_rate is None or rate > best_rate * 1.0001:
            best, best_rate = k, rate
    return best
