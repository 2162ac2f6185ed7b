"""Speculative decoding with a draft model: a smaller model of the target's vocabulary draws
the k tokens a decode brings to the target's step (engine/speculative.py verifies them).

The scheduler books a drafting decode's k positions as TO_DRAW (engine/drafting.py), and
before the step is built the draft model draws them: one step of the draft model gives every
drafting sequence its first draft, then k - 1 one-token steps the rest, dispatched back to
back (each takes the draft before it from the device) unless a grammar's mask needs the drafts
before it on the host. Each draft is drawn
as the target will draw that position: with the target's sampling parameters and the uniform
of the position (seed, output index; ops.sampling_metadata.row_uniforms), so where the two
models' distributions agree, their draws (inverse CDFs at one uniform) agree, and the target
keeps the draft. The target keeps a draft only where its own draw is that token, so the
output is the target's draws: identical to a run without speculation, greedy or seeded, and
distributed as the target's.

The draft model has its own runner (its own compile table, executables and KV pool) over
the target's page tables: the same pages, each holding the draft's K/V in its own pool. A
sequence's draft K/V is written only while it drafts: `_computed` counts the tokens written
for it, and the first step of a drafting round brings the tokens since (the whole prompt
when it first drafts, in chunks of the step budget; after a round, the last draft and the
sampled token, or just the sampled token when drafts were rejected; after steps that did not
draw, such as plain steps while a sequence waits or steps with prompt lookup's drafts, their
tokens too). Every step cuts `_computed` back to where it starts, the target's computed
tokens, so K/V the draft wrote for drafts the target rejected is never taken for context. A
preempted sequence starts again from nothing, since its pages changed.

A page from the prefix cache brings its draft K/V too where the draft wrote it for that
content: the draft records, for each page it computed whole with verified tokens, the prefix
cache's hash of the page (chained: it names every token before it too), and forgets it when
it writes the page again. A sequence that starts drafting skips its leading pages whose hash
is still the one recorded; it computes the rest (a page the draft never wrote for that
content, such as one a sequence filled while not drafting).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path

from engine.batch import InputBatch
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.distributed import is_distributed
from engine.grammar import Grammars, fill_mask_after
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import PENDING, TO_DRAW, Sequence, SequenceStatus
from engine.step_table import SPEC_TIMED_TOKENS
from models.known_models import KNOWN_MODELS, fetch_model
from models.tokenizer import Tokenizer
from ops import native
from ops.cpu_linear import X_BITS, many_rows_pay

logger = logging.getLogger(__name__)


def draft_path(name: str) -> str:
    """A draft model's files: a path, or a known model's name (fetched if missing)."""
    if name in KNOWN_MODELS:
        return str(fetch_model(name))
    if not Path(name).exists():
        raise FileNotFoundError(f"--speculative-config: draft model {name} does not exist "
                                f"(a path, or one of {', '.join(sorted(KNOWN_MODELS))})")
    return name


def check_vocabulary(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """The draft must name every token as the target does: the same id, the same piece."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {draft_name} has a vocabulary of {draft.vocab_size} "
                         f"tokens, the target {target.vocab_size}: a draft model must share "
                         "the target's vocabulary")
    ids = range(target.vocab_size)
    if draft.convert_ids_to_tokens(ids) != target.convert_ids_to_tokens(ids):
        first = next(i for i in ids if draft.id_to_token(i) != target.id_to_token(i))
        raise ValueError(f"draft model {draft_name} names token {first} "
                         f"{draft.id_to_token(first)!r}, the target {target.id_to_token(first)!r}:"
                         " a draft model must share the target's vocabulary")


def draft_config(target: EngineConfig, path: str) -> EngineConfig:
    """The draft model's configuration: the target's limits and pages, its own model, no
    drafting of its own; on a CPU that multiplies bfloat16 (ops.native.
    multiplies_bfloat16), its products of many rows (its pass over a prompt) in bfloat16: a
    draft's numbers never reach the output, which is the target's draws whatever it drafts,
    and that pass is most of what a draft model costs a fresh prompt. Not where the CPU
    kernel takes every row count (ops.cpu_linear.many_rows_pay: 8-bit x with VNNI): there
    the 0.5B's steps of 16 and 64 tokens took 81-93 and 254-311 ms against bfloat16's
    225-314 and 340-423, and 512 tokens 1.6-2.0 s against 1.4-1.6 (a 2-vCPU Zen 4 EPYC), and
    a draft model's steps of 9-64 tokens are frequent: after steps without it (prompt lookup's,
    or plain ones while a sequence waits) its first round writes the tokens since."""
    config = dataclasses.replace(target, model=path, name=None, speculative=None)
    if native.multiplies_bfloat16() and not many_rows_pay(X_BITS[config.cpu_activation_dtype]):
        config = dataclasses.replace(config, cpu_matmul_dtype="bfloat16")
    return config


class DraftModel:
    """The draft model's runner and its record of what it computed (module docstring)."""

    def __init__(self, config: EngineConfig, runner, eos_token_ids: frozenset[int]):
        self.config = config  # the draft's: the target's limits and pages, its own model
        self.runner = runner
        self.input_batch = InputBatch(config, eos_token_ids)
        self._computed: dict[int, int] = {}  # seq_id -> tokens whose draft K/V is written
        # page -> the prefix cache's hash of the content the draft's K/V there was computed
        # for, and seq_id -> how many of its leading pages were looked at for recording.
        self._page_hashes: dict[int, bytes] = {}
        self._recorded: dict[int, int] = {}
        self.num_rounds = 0
        # Seconds of each drafting round of the last `draw` that brought each sequence one or
        # two tokens (what a round costs once caught up; catching up a prompt is not one).
        self.round_seconds: list[float] = []
        self._done = 0.0  # when `draw`'s last step read was done

    @classmethod
    def for_target(cls, target: EngineConfig, tokenizer: Tokenizer) -> DraftModel:
        """Load the draft model of `target.speculative` for `target` (whose num_blocks is
        set: the draft's pool has the same pages)."""
        spec = target.speculative
        if is_distributed():
            raise ValueError("--speculative-config: a draft model runs on one host (not in a "
                             "multi-host run yet)")
        if target.tensor_parallel_size > 1:
            raise ValueError("--speculative-config: a draft model runs on one device "
                             "(tensor parallelism is not supported with it yet)")
        path = draft_path(spec.model)
        check_vocabulary(tokenizer, Tokenizer.for_model(path), spec.model)
        config = draft_config(target, path)
        logger.info("Loading the draft model %s", path)
        return cls(config, ModelRunner(config), tokenizer.eos_token_ids)

    def warmup(self, catch_up: bool = False) -> tuple[float, dict[int, float]]:
        """Compile (or load) the draft's executables; returns the seconds of one drafting
        round of one sequence (a one-token step), the cost model's starting point, and with
        `catch_up` (beside prompt lookup) those of a first round of each token bucket up to
        SPEC_TIMED_TOKENS for one sequence (StepCosts.draft_steps)."""
        self.runner.warmup()
        steps = {t: self.runner.time_step(t, 1) for t in self.config.token_buckets
                 if t <= SPEC_TIMED_TOKENS} if catch_up else {}
        return self.runner.time_step(1), steps

    def behind(self, seq: Sequence) -> int | None:
        """Tokens the next first round for `seq` would bring (None before it first drew for
        it): from its K/V's end, cut back to the target's computed tokens, through the last."""
        done = self._context(seq.seq_id, seq.num_computed_tokens)
        return None if done is None else seq.num_computed_tokens + 1 - done

    def _context(self, seq_id: int, start: int) -> int | None:
        """Tokens of a sequence's draft K/V that are context for a step from `start` (the
        target's computed tokens): those written, up to `start` (past it they are a rejected
        draft's; a step after a verified one starts after its last kept token). None before
        the model first drew for it."""
        done = self._computed.get(seq_id)
        return None if done is None else min(done, start)

    def draw(self, out: SchedulerOutput, seeds: dict[int, int],
             grammar: tuple[Grammars, dict] | None = None,
             cache: BlockManager | None = None) -> None:
        """Draw the drafts booked (TO_DRAW) in `out`, in place: into each entry's `drafts` and
        its sequence's tokens. `grammar`: (the engine's Grammars, seq_id -> matcher): a
        sequence that follows one draws each draft under its mask after the drafts before.
        `cache`: the target's pages, whose prefix cache's hashes let a sequence skip the
        pages whose draft K/V is there already (module docstring)."""
        for seq in out.preempted:  # its pages change: its draft K/V is written afresh
            self._forget(seq.seq_id)
            self.input_batch.release(seq.seq_id)
        for seq_id in [i for i, (_, s) in self.input_batch.seqs.items()
                       if s.status is not SequenceStatus.RUNNING]:
            self._forget(seq_id)
        self.round_seconds = []
        for e in out.scheduled:  # K/V past the target's computed tokens is of rejected drafts
            done = self._context(e.seq.seq_id, e.start)
            if done is not None:
                self._computed[e.seq.seq_id] = done
        entries = [e for e in out.scheduled if e.drafts and not e.looked_up]
        if not entries:
            return
        by_id = {e.seq.seq_id: e for e in entries}
        for e in entries:
            sid = e.seq.seq_id
            if sid not in self._computed:
                self._computed[sid] = self._written(e.seq, cache) if cache is not None else 0
            if cache is not None:
                self._record(e.seq, cache)
        # The first round: each sequence's tokens since its draft K/V, through the last one;
        # then one token a round, the draft before it. Without a grammar the rounds go to the
        # device back to back, each taking the token the round before it drew from the device
        # (PENDING, as an overlapped decode takes its token), and their drafts are read after
        # the last; a grammar's mask for draft j needs the drafts before it on the host.
        steps = []  # (chunks, the dispatched step, the draft its chunks draw, when it began)

        def dispatch(chunks: list[ScheduledSeq], j: int) -> None:
            steps.append(self._submit(chunks, by_id, j, seeds, grammar))
            if grammar is not None:
                self._collect(steps, by_id)

        budget = self.config.max_num_batched_tokens
        behind = list(entries)
        while behind:
            chunks, left = [], budget
            for e in behind:
                if left == 0 or len(chunks) == self.config.max_num_seqs:
                    break
                done = self._computed[e.seq.seq_id]
                n = min(e.start + 1 - done, left)
                chunks.append(ScheduledSeq(e.seq, n, done, samples=done + n == e.start + 1))
                left -= n
            dispatch(chunks, 0)
            behind = [e for e in behind if self._computed[e.seq.seq_id] < e.start + 1]
        for j in range(1, max(len(e.drafts) for e in entries)):
            chunks = [ScheduledSeq(e.seq, 1, e.start + j, samples=True) for e in entries
                      if len(e.drafts) > j]
            for c in chunks:  # draft j - 1, if not read yet: on the device
                if c.seq.token_ids[c.start] == TO_DRAW:
                    c.seq.token_ids[c.start] = PENDING
            dispatch(chunks, j)
        self._collect(steps, by_id)

    def _forget(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)
        self._recorded.pop(seq_id, None)

    def _written(self, seq: Sequence, cache: BlockManager) -> int:
        """Tokens of `seq`'s leading pages that hold the draft's K/V for their content."""
        n = 0
        for block in seq.block_table:
            h = cache.block_hash(block)
            if h is None or self._page_hashes.get(block) != h:
                break
            n += 1
        return n * self.config.block_size

    def _record(self, seq: Sequence, cache: BlockManager) -> None:
        """Record the hashes of `seq`'s pages the draft has computed whole (their tokens are
        the target's: `_computed` is past no rejected draft here)."""
        sid = seq.seq_id
        whole = self._computed[sid] // self.config.block_size
        i = min(self._recorded.get(sid, 0), whole)
        while i < whole:
            h = cache.block_hash(seq.block_table[i])
            if h is None:  # the target has not registered it yet
                break
            self._page_hashes[seq.block_table[i]] = h
            i += 1
        self._recorded[sid] = i

    def _submit(self, chunks: list[ScheduledSeq], entries: dict[int, ScheduledSeq], j: int,
                seeds: dict[int, int], grammar):
        """Dispatch one step of the draft model over `chunks` (a chunk that samples draws its
        entry's draft j, the token at position entry.start + 1 + j) and book what it writes;
        `_collect` reads its drafts."""
        started = time.perf_counter()
        batch = self.input_batch.build(SchedulerOutput(chunks, []), seeds)
        if grammar is not None:
            grammars, matchers = grammar
            rows = [(row, matchers[c.seq.seq_id], entries[c.seq.seq_id].drafts[:j])
                    for row, c in enumerate(chunks) if c.samples and c.seq.seq_id in matchers]
            if rows:
                batch.token_mask = functools.partial(fill_mask_after, grammars, rows,
                                                     batch.bucket[1])
        pending = self.runner.submit(batch)
        self.num_rounds += 1
        size = self.config.block_size
        for chunk in chunks:
            sid = chunk.seq.seq_id
            table = chunk.seq.block_table
            for i in range(chunk.start // size, (chunk.end - 1) // size + 1):
                self._page_hashes.pop(table[i], None)  # written again: recorded afresh
            self._computed[sid] = chunk.end
        return chunks, pending, j, started

    def _collect(self, steps: list, entries: dict[int, ScheduledSeq]) -> None:
        """Wait for the dispatched steps in order (emptying `steps`) and write their drafts.
        A round that brought each sequence a token or two is timed into `round_seconds`,
        from when it began or, if later, when the round before it was done (the device's
        time where the rounds ran back to back)."""
        for chunks, pending, j, started in steps:
            result = pending.result()
            now = time.perf_counter()
            if max(c.num_new_tokens for c in chunks) <= 2:
                self.round_seconds.append(now - max(started, self._done))
            self._done = now
            for row, chunk in enumerate(chunks):
                if chunk.samples:
                    entry = entries[chunk.seq.seq_id]
                    token = int(result.token_ids[row])
                    entry.drafts[j] = token
                    entry.seq.token_ids[entry.start + 1 + j] = token
        steps.clear()
