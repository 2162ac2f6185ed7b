"""Scheduler: which sequences run in the next step, and how many tokens each brings.

Continuous batching under a token budget (`max_num_batched_tokens`) and a sequence
cap (`max_num_seqs`): running sequences first (decodes and unfinished prefill
chunks), then new prompts from the waiting queue, chunked to fit the budget. When
KV blocks run out, the newest running sequence is preempted by recompute: its
blocks are freed and it goes back to the front of the waiting queue with the
tokens it has so far.

Steps may overlap: the engine dispatches step n+1 before it reads step n's tokens. So a
sequence's progress is booked when it is scheduled (`num_computed_tokens` advances, and a
sampled token takes a PENDING place in `token_ids` that the next step reads on the device),
and `postprocess` fills in the token later. A sequence whose pending token is its last
(max_tokens, max_model_len) is not scheduled again; one that stops on a token it learns late
drops the pending token after it (never shown) and frees its blocks.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.draft_costs import expected_tokens
from engine.drafting import Drafting
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import fit_drafts


class RequestRejected(ValueError):
    """A request that can never be served with this engine's limits."""


class SchedulerStuck(RuntimeError):
    """Work is waiting but nothing can be scheduled: a bookkeeping bug, never a busy loop."""


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    start: int  # first token index computed in this step (== seq.num_computed_tokens then)
    # Whether this step reaches the sequence's last token, so a new token is sampled (set when
    # the step is booked; the token's place is token_ids[start + num_new_tokens]).
    samples: bool = False
    # Proposed tokens at the end of this chunk (speculative decoding, engine/speculative.py):
    # the step samples after each of its last len(drafts) + 1 positions.
    drafts: list[int] = dataclasses.field(default_factory=list)
    # Whether they are prompt lookup's beside a draft model (which draws the others).
    looked_up: bool = False
    # The tokens the step added to the sequence, set by `postprocess`: the kept drafts and the
    # token sampled after them, up to a stop.
    new_tokens: list[int] = dataclasses.field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def num_rows(self) -> int:
        """The head's rows for this entry: one, plus one per draft."""
        return 1 + len(self.drafts)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_rows(self) -> int:
        """The head's rows: one per entry, plus one per draft."""
        return sum(s.num_rows for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.config = config
        self.blocks = block_manager
        self.eos_token_ids = eos_token_ids
        if block_manager.num_usable_blocks < config.max_blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {block_manager.num_usable_blocks} blocks of "
                f"{config.block_size} tokens ({block_manager.num_usable_blocks * config.block_size}"
                f" tokens), less than one sequence of max_model_len {config.max_model_len} "
                f"tokens needs ({config.max_blocks_per_seq} blocks): give it more pages or lower "
                f"max_model_len")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.drafting = Drafting(config, block_manager)  # speculative decoding's share

    # ---- admission ---------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        cfg = self.config
        if num_prompt_tokens < 1:
            raise RequestRejected("the prompt is empty")
        if max_tokens is not None and num_prompt_tokens + max_tokens > cfg.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {cfg.max_model_len} tokens, but the "
                f"request needs {num_prompt_tokens} prompt tokens + max_tokens {max_tokens} = "
                f"{num_prompt_tokens + max_tokens}")
        if num_prompt_tokens >= cfg.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {cfg.max_model_len} tokens, but the "
                f"prompt has {num_prompt_tokens} tokens and leaves no room for output")
        # Without max_tokens a request may grow to max_model_len, which the cache holds
        # (checked at start-up), so no admitted sequence can outgrow the cache on its own.

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_prompt_tokens, seq.params.max_tokens)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------

    def schedule(self, speculate: bool = False) -> SchedulerOutput:
        """The next step. With `speculate` (the engine has read every token: no PENDING ones),
        decodes that may draft bring their proposed tokens (engine/speculative.py)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        num_drafts = 0  # the head has max_num_seqs rows: one per sequence, one per draft
        gain = 0.0      # tokens the step is expected to add (drafting's cost model)

        # 1. Running sequences, oldest first: decodes and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._ends_with_pending(seq):  # its last token is being sampled: nothing to do
                i += 1
                continue
            # A decode token appended last step may need a fresh block for its K/V.
            while not self.blocks.can_append(seq):
                victim = self.running.pop()  # the newest running sequence
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.may_append(seq)
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                entry = ScheduledSeq(seq, n, seq.num_computed_tokens)
                # Only a decode drafts: not a prompt's last token alone in a step (a chunk
                # kept in its bucket), whose first token must not wait for a draft model's
                # pass over the prompt.
                if speculate and n == 1 and seq.num_output_tokens:
                    rows = self.config.max_num_seqs - len(self.running) - num_drafts
                    tokens = self.config.max_num_batched_tokens - budget
                    self.drafting.draft(entry, min(budget - 1, rows), tokens, gain)
                    num_drafts += len(entry.drafts)
                if n == seq.num_tokens - seq.num_computed_tokens:  # a decode: it samples
                    gain += expected_tokens(self.drafting.acceptance(seq, entry.looked_up),
                                            len(entry.drafts))
                scheduled.append(entry)
                budget -= entry.num_new_tokens
                i += 1
                continue
            break  # seq itself was preempted: nothing after it is running any more

        # 2. Waiting sequences (new, or preempted and recomputed), chunked to the budget.
        # Not in a step that had to preempt: the freed blocks would only thrash.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) + num_drafts < self.config.max_num_seqs):
            seq = self.waiting[0]
            # Preempted while a step with its token was in flight: recompute it once known.
            if (seq.num_pending or not self.blocks.can_allocate(seq)
                    or self._waits_for_sibling(seq)):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)  # sets num_computed_tokens from prefix-cache hits
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
            budget -= n
        if num_drafts:
            fit_drafts(scheduled, num_drafts, self.config.token_buckets, self.blocks)
        self._trim_to_bucket(scheduled)
        # Sequences with history (computed tokens) first: the reference attention reads
        # history only up to the last row that has any.
        scheduled.sort(key=lambda e: e.start == 0)
        for e in scheduled:  # book the step (see the module docstring)
            e.samples = e.end == e.seq.num_tokens
            e.seq.num_computed_tokens = e.end
            if e.samples:
                e.seq.append_pending()
        if not scheduled and self.has_unfinished() and not any(
                s.num_pending for s in (*self.running, *self.waiting)):
            raise SchedulerStuck(
                f"nothing could be scheduled with {len(self.waiting)} waiting and "
                f"{len(self.running)} running sequences and {self.blocks.num_free_blocks} of "
                f"{self.blocks.num_usable_blocks} KV blocks free")
        return SchedulerOutput(scheduled, preempted)

    def may_speculate(self) -> bool:
        """Whether the next step may draft (engine/drafting.py)."""
        return self.drafting.may_speculate(self.running)

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        """n > 1: the sequences of one request share their prompt. While a sibling computes
        it, the others wait (a step or two), then find its full blocks in the prefix cache and
        compute only the block of the last prompt token (never shared, see BlockManager)."""
        shared = (seq.num_prompt_tokens - 1) // self.config.block_size  # blocks a hit can give
        if (not self.blocks.enable_prefix_caching or shared == 0 or seq.num_output_tokens
                or seq.params.n == 1):
            return False
        return any(other.request_id == seq.request_id
                   and self.blocks.num_cached_blocks_of(other) < shared
                   for other in self.running)

    def _trim_to_bucket(self, scheduled: list[ScheduledSeq]) -> None:
        """A step costs its padded bucket. When a prefill chunk takes a step just past a
        bucket, move the excess to the next step if the two steps then cost less, counting a
        step's cost as its bucket size (8 decodes + a 128-token prompt: 128 + 16 rows instead
        of 256 + 8)."""
        total = sum(e.num_new_tokens for e in scheduled)
        below = max((b for b in self.config.token_buckets if b <= total), default=total)
        excess = total - below
        chunk = next((e for e in reversed(scheduled)
                      if e.num_new_tokens > max(excess, 1) and not e.drafts), None)
        if excess == 0 or chunk is None:
            return
        bucket = lambda n: self.config.bucket_for(n, 1)[0]
        following = len(scheduled)  # about the sequences the next step will bring
        if below + bucket(following + excess) < bucket(total) + bucket(following):
            chunk.num_new_tokens -= excess

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _ends_with_pending(self, seq: Sequence) -> bool:
        if not seq.num_pending:
            return False
        p = seq.params
        return ((p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens)
                or seq.num_tokens >= self.config.max_model_len)

    def postprocess(self, out: SchedulerOutput,
                    sampled: list[list[int] | None]) -> list[Sequence]:
        """Record a step's results; `sampled[i]` holds the tokens of `out.scheduled[i]`'s
        head rows (one, or one per draft plus one; None when that entry only computed a prefill
        chunk). Sets each entry's `new_tokens`. Returns sequences that finished."""
        finished = []
        for entry, rows in zip(out.scheduled, sampled, strict=True):
            seq = entry.seq
            if seq.is_finished:  # aborted or stopped while the step ran
                continue
            running = seq.status is SequenceStatus.RUNNING  # not preempted since: K/V written
            if not entry.samples:
                if running:
                    self.blocks.mark_computed(seq, entry.end)
                continue
            gained, computed = rows[:1], entry.end
            if entry.drafts:
                gained = self.drafting.verify(entry, rows)
                computed = seq.num_computed_tokens
            entry.new_tokens, reason = [], None
            position = seq.num_tokens if entry.drafts else entry.end  # of the first token
            for token in gained:
                if entry.drafts:
                    seq.append_token(token)
                else:
                    seq.resolve(position, token)
                entry.new_tokens.append(token)
                position += 1
                reason = self._stop_reason(seq, token, position)
                if reason is not None:
                    break
            if running:
                self.blocks.mark_computed(seq, min(computed, position))
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            elif entry.drafts:
                self.blocks.trim(seq)  # pages that held only rejected drafts
        return finished

    def _stop_reason(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        """Whether `token`, the sequence's `num_tokens`-th, ends it."""
        p = seq.params
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= p.min_tokens:
            if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                return "stop"
        if p.max_tokens is not None and num_output >= p.max_tokens:
            return "length"
        if num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (finished, stopped by a stop string, or aborted) and free its blocks."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.drafting.forget(seq)
        seq.truncate(seq.num_tokens - seq.num_pending)  # a token past the end is never shown
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        # A finished turn of a stored conversation: its session keeps the blocks cached.
        self.blocks.deallocate(seq, keep_for=seq.session if reason != "abort" else None)
