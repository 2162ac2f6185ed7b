"""The scheduler's drafting half (speculative decoding; the method and the acceptance rule
are engine/speculative.py's, the cost model engine/draft_costs.py's): which decodes of a step
draft and how many tokens, and what each drafting entry keeps once its step is read.

One `Drafting` per scheduler. It holds each sequence's `Drafter` (its acceptance, and its
pause after drafts that gained nothing), the engine's counters (`stats`, read by /metrics
and the bench) and the step times the cost model reads (`step_costs`, which the engine
times steps into).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.draft_costs import StepCosts, choose_drafts
from engine.sequence import TO_DRAW, Sequence
from engine.speculative import Drafter, SpecDecodeStats, accepted_length, may_match, propose

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq


class Drafting:
    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.drafters: dict[int, Drafter] = {}  # seq_id -> its drafting state
        self.stats = SpecDecodeStats()
        self.step_costs = StepCosts()
        # seq_id -> (its length, the proposal for it): `may_look_up`'s lookup on a sequence
        # with no token in flight, which `draft` takes in the same step instead of looking
        # up again (cleared each step: a sequence cut back may regrow to the same length)
        self._proposed: dict[int, tuple[int, list[int]]] = {}
        # A draft model beside prompt lookup (set by the engine): how many tokens its next
        # first round would bring for a sequence (None before it first drew for it).
        self.draft_behind: Callable[[Sequence], int | None] | None = None

    def may_draft(self, seq: Sequence) -> bool:
        """Whether a decoding sequence drafts now: not under penalties (their counts are per
        slot on the device), and not while it waits after drafts that gained nothing. (A
        grammar's drafts are cut where it forbids them, and each verified row gets its mask:
        the engine's.)"""
        p = seq.params
        drafter = self.drafters.get(seq.seq_id)
        return (p.presence_penalty == 0 and p.frequency_penalty == 0
                and p.repetition_penalty == 1 and seq.num_tokens - seq.num_computed_tokens <= 1
                and (drafter is None or drafter.ready(seq.num_output_tokens)))

    def pays(self, seq: Sequence, tokens: int, gain: float, room: int,
             looked_up: bool = False, catch_up: bool = True) -> int:
        """Drafts (0 .. room) that pay for `seq` in a step of `tokens` tokens and `gain`
        (`choose_drafts`), in full while it probes after having stepped aside. A draft model's
        drafts cost its rounds and, beside prompt lookup, its catching up (`_catch_up`, unless
        not `catch_up`); `looked_up`: prompt lookup's beside a draft model, which cost
        nothing to find."""
        costs, per_draft, fixed = self.step_costs, 0.0, 0.0
        if not looked_up:
            drafter = self.drafters.get(seq.seq_id)
            if drafter is not None and drafter.probing:
                return room
            per_draft = costs.draft_round or 0.0
            fixed = self._catch_up(seq) if catch_up else 0.0
        return choose_drafts(self.acceptance(seq, looked_up), room, tokens, gain,
                             self._bucket_of, costs, per_draft, fixed)

    def _bucket_of(self, num_tokens: int) -> int:
        return self.config.bucket_for(num_tokens, 1)[0]

    def _catch_up(self, seq: Sequence) -> float:
        """Beside prompt lookup, what a draft model's drafts for `seq` cost first: its round
        over the tokens lookup's steps brought since it last drew (StepCosts.catch_up), spread
        over the tokens since lookup last drafted (a sequence past the text it repeats will
        draw for a while; one between two of its matches will not). Its first drawing's pass
        over the prompt is paid once a request, as without lookup: not counted."""
        behind = None if self.draft_behind is None else self.draft_behind(seq)
        if behind is None:
            return 0.0
        drafter = self.drafters.get(seq.seq_id)
        since = max(1, seq.num_output_tokens - (drafter.looked_up_at if drafter else 0))
        return self.step_costs.catch_up(behind, self._bucket_of) / since

    def may_speculate(self, running: list[Sequence]) -> bool:
        """Whether the next step of `running` may draft (the engine then reads the step in
        flight first, as drafts continue from the last token): only while the batch is small,
        and some decode would draft by the cost model."""
        self._proposed.clear()
        spec = self.config.speculative  # None: no drafting
        if spec is None or not 0 < len(running) <= spec.seq_limit(self.config.max_num_seqs):
            return False
        others = len(running) - 1  # about what the other decodes bring
        room = min(spec.num_speculative_tokens, self.config.max_num_batched_tokens - others - 1)
        model = spec.method == "draft_model"
        return any(self.may_draft(s) and (
            (model and self.pays(s, others, others, room) > 0)
            or (spec.looks_up and self.may_look_up(s)
                and self.pays(s, others, others, room, looked_up=model) > 0))
            for s in running)

    def may_look_up(self, seq: Sequence) -> bool:
        """Whether prompt lookup may find drafts for `seq`'s next step: whether its known
        tokens leave a match possible (`may_match`), so that a sequence in text that repeats
        nothing keeps its overlapped steps."""
        spec = self.config.speculative
        if seq.num_pending:
            return may_match(seq.token_ids[:len(seq.token_ids) - seq.num_pending],
                             spec.prompt_lookup_min)
        return bool(self._propose(seq))

    def _propose(self, seq: Sequence) -> list[int]:
        """Prompt lookup's num_speculative_tokens drafts for `seq` as it is (no token in
        flight), looked up once however often asked at this length."""
        cached = self._proposed.get(seq.seq_id)
        if cached is not None and cached[0] == seq.num_tokens:
            return cached[1]
        spec = self.config.speculative
        drafts = propose(seq.token_ids, spec.num_speculative_tokens, spec.prompt_lookup_max,
                         spec.prompt_lookup_min)
        self._proposed[seq.seq_id] = (seq.num_tokens, drafts)
        return drafts

    def draft(self, entry: ScheduledSeq, room: int, tokens: int, gain: float) -> None:
        """Append up to `room` proposed tokens to a decode's chunk, as many as pay (`pays`),
        if its pages hold them. `tokens`, `gain`: the step's tokens and expected gain so far."""
        seq, spec, p = entry.seq, self.config.speculative, entry.seq.params
        if seq.num_pending or not self.may_draft(seq):
            return
        room = min(room, spec.num_speculative_tokens,
                   self.config.max_model_len - seq.num_tokens - 1)  # the sampled token fits
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - seq.num_output_tokens - 1)
        if room < 1:
            return
        drafter = self.drafter(seq)
        # (the lookup's match does not depend on k)
        drafts = self._propose(seq)[:room] if spec.looks_up else []
        model = spec.method == "draft_model"
        looked_up = bool(drafts) and model
        if looked_up:  # prompt lookup first; a draft model's where it finds nothing or loses
            drafter.looked_up_at = seq.num_output_tokens
            drafts = drafts[:self.pays(seq, tokens, gain, len(drafts), looked_up=True)]
        if not drafts and model:
            looked_up = False  # drawn once the step is booked (engine/draft_model.py)
            drafts = [TO_DRAW] * room
        if not drafts:
            drafter.record(seq.num_output_tokens, 0, 0)
            return
        if not looked_up:
            drafts = drafts[:self.pays(seq, tokens, gain, len(drafts))]
            # (beside lookup, drafts that would pay but for the model's catching up: a plain
            # step, lookup tried again at the next)
            if not drafts and not (model and spec.looks_up
                                   and self.pays(seq, tokens, gain, room, catch_up=False)):
                drafter.step_aside(seq.num_output_tokens)
            if not drafts:
                return
        seq.token_ids.extend(drafts)
        if not self.blocks.can_append(seq):
            seq.truncate(seq.num_tokens - len(drafts))
            return
        self.blocks.may_append(seq)
        entry.drafts = drafts
        entry.looked_up = looked_up
        entry.num_new_tokens += len(drafts)

    def acceptance(self, seq: Sequence, looked_up: bool = False) -> float:
        """How often `seq`'s drafts are kept (`looked_up`: its prompt lookup's beside a draft
        model): its drafter's, or before it has one, what the sequences before it met lately
        (SpecDecodeStats.recent_acceptance)."""
        drafter = self.drafters.get(seq.seq_id)
        if drafter is None:
            return self.stats.recent_acceptance
        return drafter.lookup_acceptance if looked_up else drafter.acceptance

    def drafter(self, seq: Sequence) -> Drafter:
        """A sequence's drafting state, made on first use from `acceptance`."""
        if seq.seq_id not in self.drafters:
            self.drafters[seq.seq_id] = Drafter(acceptance=self.acceptance(seq))
        return self.drafters[seq.seq_id]

    def verify(self, entry: ScheduledSeq, rows: list[int]) -> list[int]:
        """A drafting entry's result: keep the drafts up to the first that differs from the
        token sampled before it, then that sampled token; roll the rest back (their K/V is
        recomputed when reached again, never cached). Returns the tokens gained."""
        seq, drafts = entry.seq, entry.drafts
        kept = accepted_length(drafts, rows)
        self.stats.record(len(drafts), kept)
        base = entry.start + 1  # the last token before the drafts is computed
        if entry.looked_up:  # beside a draft model: no waiting, the model drafts next
            self.drafter(seq).record_lookup(len(drafts), kept)
        else:
            self.drafter(seq).record(base - seq.num_prompt_tokens, len(drafts), kept)
        seq.truncate(base)  # the drafts and the pending token
        seq.num_computed_tokens = base + kept
        return [*drafts[:kept], rows[kept]]

    def forget(self, seq: Sequence) -> None:
        """A finished sequence's drafting state goes."""
        self.drafters.pop(seq.seq_id, None)
