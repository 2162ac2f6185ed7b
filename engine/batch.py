"""The persistent input batch: scheduled steps -> padded numpy inputs in two buffers.

Each running sequence holds a slot (0 .. max_num_seqs - 1) from the step that admits it
until it finishes or is preempted. What a request fixes (sampling parameters, seed, stop
ids banned before min_tokens, logit_bias, prompt length) is written into the slot's columns
once, at admission; a page table row per slot grows as the sequence's blocks do. A step is
then a few vectorised gathers from those columns plus the new rows' token ids, laid out in
two buffers (one int32, one float32), so the device gets two transfers a step.

The layouts (`body_layout`, `sampling_layout`) are the one definition of where each input
sits: `StepBatch` exposes named views into the buffers (tests, fake runners) and the model
runner unpacks the same offsets inside the compiled step.

Steps may overlap (engine/scheduler.py): a decode row whose token is still PENDING on the
device names its slot in `token_slot`, and the device takes that slot's last sampled token.
Repetition, frequency and presence penalties count tokens on the device per slot: a slot
admitted for a request with penalties is reset there from its prompt and output so far
(`StepBatch.resets`), and each sampled token bumps its slot's counts. Nothing
`[S, max_model_len]`-sized travels per step.

The only shapes the device sees come from `EngineConfig.bucket_for`, shared with warmup.
Padded token rows write their K/V to the reserved page 0; padded sequences have no query
rows, zero KV length and an all-page-0 table; padded sampling rows (and rows that sample
nothing this step) use the spare slot `max_num_seqs`, whose columns are neutral.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import numpy as np

from engine.config import EngineConfig
from engine.sampling_params import FLOAT_DTYPE, INT_DTYPE, MAX_LOGIT_BIAS
from engine.scheduler import SchedulerOutput
from engine.sequence import PENDING, Sequence, SequenceStatus

# Ids a row can be kept from picking (EOS + stop token ids before min_tokens); equals
# ops.sampling_metadata.MAX_BANNED, which this bookkeeping module may not import (as
# MAX_LOGIT_BIAS equals its namesake there; tests/test_logit_bias.py checks both).
MAX_BANNED = 16

FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
NEUTRAL = {"top_p": 1.0, "repetition_penalty": 1.0}  # other columns: 0 = off
# int32 sampling rows: name -> how many rows of the buffer it takes ([S] or [S, k] columns)
INT_COLUMNS = {"top_k": 1, "steps": 1, "num_top_logprobs": 1, "slots": 1, "seeds": 2,
               "banned_tokens": MAX_BANNED, "constrained": 1,
               "logit_bias_ids": MAX_LOGIT_BIAS}
# float32 sampling rows: FLOAT_COLUMNS ([S] each), then these ([S, k] columns)
FLOAT_BLOCKS = {"logit_bias": MAX_LOGIT_BIAS}


@functools.cache
def body_layout(config: EngineConfig, num_tokens: int) -> dict[str, tuple[int, tuple]]:
    """Where each model-body input sits in the step's int32 buffer: name -> (offset, shape).
    Cached (every step asks); callers must not change the result."""
    t, sb = num_tokens, config.body_seqs(num_tokens)
    shapes = {"tokens": (t,), "token_slot": (t,), "positions": (t,), "token_seq": (t,),
              "slot_mapping": (t,), "query_start_loc": (sb + 1,), "kv_lens": (sb,),
              "page_tables": (sb, config.max_blocks_per_seq),
              "logits_indices": (config.max_num_seqs,)}
    out, offset = {}, 0
    for name, shape in shapes.items():
        out[name] = (offset, shape)
        offset += int(np.prod(shape))
    return out


def body_tokens(config: EngineConfig, size: int) -> int:
    """The token bucket whose body buffer has `size` entries."""
    for t in config.token_buckets:
        if _size(body_layout(config, t)) == size:
            return t
    raise ValueError(f"no token bucket has a body buffer of {size} entries")


@functools.cache
def sampling_layout() -> dict[str, tuple[int, int]]:
    """Rows of the [k, S] int32 sampling buffer: name -> (first row, rows)."""
    return _rows(INT_COLUMNS)


@functools.cache
def float_layout() -> dict[str, tuple[int, int]]:
    """Rows of the [k, S] float32 sampling buffer: name -> (first row, rows); FLOAT_COLUMNS
    first, in their order."""
    return _rows({**dict.fromkeys(FLOAT_COLUMNS, 1), **FLOAT_BLOCKS})


def _rows(columns: dict[str, int]) -> dict[str, tuple[int, int]]:
    out, row = {}, 0
    for name, rows in columns.items():
        out[name] = (row, rows)
        row += rows
    return out


NUM_FLOAT_ROWS = len(FLOAT_COLUMNS) + sum(FLOAT_BLOCKS.values())


def _size(layout: dict[str, tuple[int, tuple]]) -> int:
    return max(off + int(np.prod(shape)) for off, shape in layout.values())


@functools.cache
def _template(config: EngineConfig, bucket: tuple[int, int]):
    """An all-padding bucket's buffers and each body view's (name, start, end, shape): what
    `empty_batch` copies every step (the numpy calls that lay them out cost more than the
    rest of a lone decode's batch). Cached; callers copy the buffers before writing."""
    t, s = bucket
    layout = body_layout(config, t)
    body = np.zeros(_size(layout), np.int32)
    views = [(name, off, off + int(np.prod(shape)), shape) for name, (off, shape) in layout.items()]
    for name, start, end, _ in views:
        if name in ("token_seq", "token_slot"):
            body[start:end] = -1
    ints = np.zeros((sum(INT_COLUMNS.values()), s), INT_DTYPE)
    layout_s = sampling_layout()
    for name in ("banned_tokens", "logit_bias_ids"):  # -1: no id
        r, k = layout_s[name]
        ints[r:r + k] = -1
    ints[layout_s["slots"][0]] = config.max_num_seqs  # the spare, neutral slot
    floats = np.zeros((NUM_FLOAT_ROWS, s), FLOAT_DTYPE)
    for i, name in enumerate(FLOAT_COLUMNS):
        floats[i] = NEUTRAL.get(name, 0.0)
    return body, ints, floats, views


@dataclasses.dataclass
class StepBatch:
    """One step's inputs. The model body sees the token rows (T) and the attention metadata of
    `config.body_seqs(T)` sequences; the LM head and sampler see S sampling rows."""

    bucket: tuple[int, int]        # (tokens T, head rows S)
    num_rows: int                  # real head rows: one per sequence, one more per draft
                                   # (rows past it are padding)
    body: np.ndarray               # int32 buffer, laid out by body_layout
    sampling_ints: np.ndarray      # [sum(INT_COLUMNS.values()), S] int32
    sampling_floats: np.ndarray    # [NUM_FLOAT_ROWS, S] float32, laid out by float_layout
    # (slot, prompt ids, output ids) of slots whose penalty counts start afresh this step
    resets: list[tuple[int, np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    # The constrained rows' token mask ([S, ceil(V / 32)] int32, engine/grammar.py), computed
    # by this callable once the body is dispatched; None when no row follows a grammar.
    token_mask: Callable[[], np.ndarray] | None = None
    views: dict[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)

    def __getattr__(self, name: str) -> np.ndarray:  # named views: batch.tokens, ...
        views = self.__dict__.get("views", {})
        if name in views:
            return views[name]
        raise AttributeError(name)

    @property
    def sampling(self) -> dict[str, np.ndarray]:
        """The sampling rows by name: [S] columns, seeds [S, 2] uint32, banned [S, B], logit
        bias ids and biases [S, L]."""
        out = {}
        for layout, buffer in ((sampling_layout(), self.sampling_ints),
                               (float_layout(), self.sampling_floats)):
            for name, (row, rows) in layout.items():
                block = buffer[row:row + rows]
                out[name] = block[0] if rows == 1 else block.T
        out["seeds"] = out["seeds"].view(np.uint32)
        return out

    def host_tokens(self, last_tokens: np.ndarray) -> np.ndarray:
        """The token rows with PENDING ones taken from `last_tokens[slot]` (what a device keeps:
        for runners that compute on the host)."""
        return np.where(self.token_slot >= 0, last_tokens[self.token_slot], self.tokens)


def empty_batch(config: EngineConfig, bucket: tuple[int, int]) -> StepBatch:
    """An all-padding batch of a bucket's shape (warmup runs these)."""
    body, ints, floats, layout = _template(config, bucket)
    body = body.copy()
    views = {name: body[start:end].reshape(shape) for name, start, end, shape in layout}
    return StepBatch(bucket=bucket, num_rows=0, body=body, sampling_ints=ints.copy(),
                     sampling_floats=floats.copy(), views=views)


class InputBatch:
    """Slots of the running sequences and their columns (see the module docstring)."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset()):
        self.config = config
        self.eos_token_ids = eos_token_ids
        n = config.max_num_seqs
        self.spare = n  # padding rows and rows that sample nothing this step
        self.seqs: dict[int, tuple[int, Sequence]] = {}  # seq_id -> (slot, sequence)
        self._free = list(range(n - 1, -1, -1))  # pop() hands out the lowest slot first
        self.floats = np.zeros((len(FLOAT_COLUMNS), n + 1), FLOAT_DTYPE)
        for i, name in enumerate(FLOAT_COLUMNS):
            self.floats[i] = NEUTRAL.get(name, 0.0)
        self.top_k = np.zeros(n + 1, INT_DTYPE)
        self.num_top_logprobs = np.full(n + 1, -1, np.int32)  # -1: no logprobs
        self.seeds = np.zeros((n + 1, 2), np.uint32)
        self.banned = np.full((n + 1, MAX_BANNED), -1, INT_DTYPE)
        self.bias_ids = np.full((n + 1, MAX_LOGIT_BIAS), -1, INT_DTYPE)  # sorted, then -1
        self.biases = np.zeros((n + 1, MAX_LOGIT_BIAS), FLOAT_DTYPE)
        self.min_tokens = np.zeros(n + 1, INT_DTYPE)
        self.constrained = np.zeros(n + 1, np.int32)  # follows a grammar (engine/grammar.py)
        self.prompt_lens = np.zeros(n + 1, np.int32)
        self.page_tables = np.zeros((n + 1, config.max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(n + 1, np.int32)  # filled entries of each page table row
        self.table_cuts = np.zeros(n + 1, np.int64)  # each copy's Sequence.table_cuts

    # ---- slots ------------------------------------------------------------------------

    def _release_departed(self) -> None:
        """Free the slots of sequences that finished or were preempted since the last step."""
        for seq_id, (_, seq) in list(self.seqs.items()):
            if seq.status is not SequenceStatus.RUNNING:
                self.release(seq_id)

    def release(self, seq_id: int) -> None:
        """Free a sequence's slot now (a batch not built every step, a draft model's, frees a
        preempted sequence's here: it may run again, with other pages, before its next build)."""
        held = self.seqs.pop(seq_id, None)
        if held is not None:
            slot = held[0]
            self.page_tables[slot, :self.num_blocks[slot]] = 0
            self.num_blocks[slot] = 0
            self._free.append(slot)

    def _admit(self, seq: Sequence, seed: int,
               resets: list[tuple[int, np.ndarray, np.ndarray]]) -> int:
        slot = self._free.pop()
        self.seqs[seq.seq_id] = (slot, seq)
        p = seq.params
        for i, name in enumerate(FLOAT_COLUMNS):
            self.floats[i, slot] = getattr(p, name)
        self.top_k[slot] = p.top_k
        self.num_top_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.seeds[slot] = (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF
        banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
        # A grammar decides itself when the end may come (its mask allows EOS exactly then).
        banned = banned[:MAX_BANNED] if p.min_tokens and p.structured_outputs is None else []
        self.banned[slot] = -1
        self.banned[slot, :len(banned)] = banned
        self.bias_ids[slot], self.biases[slot] = -1, 0.0
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            self.bias_ids[slot, :len(ids)] = ids
            self.biases[slot, :len(ids)] = biases
        self.min_tokens[slot] = p.min_tokens
        self.constrained[slot] = p.structured_outputs is not None
        self.prompt_lens[slot] = seq.num_prompt_tokens
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            resets.append((slot, np.asarray(seq.token_ids[:seq.num_prompt_tokens], np.int32),
                           np.asarray(seq.output_token_ids, np.int32)))
        return slot

    # ---- one step ---------------------------------------------------------------------

    def build(self, out: SchedulerOutput, seeds: dict[int, int]) -> StepBatch:
        """The inputs of a booked step (scheduler.schedule has run); `seeds` maps seq_id ->
        the 64-bit seed of its sampling stream."""
        self._release_departed()
        cfg, entries = self.config, out.scheduled
        num_seqs, num_tokens, num_rows = len(entries), out.num_tokens, out.num_rows
        batch = empty_batch(cfg, cfg.bucket_for(num_tokens, num_rows))
        batch.num_rows = num_rows
        if not entries:
            return batch
        v = batch.views
        slots = np.empty(num_seqs, np.int32)
        for i, e in enumerate(entries):
            seq = e.seq
            held = self.seqs.get(seq.seq_id)
            slot = held[0] if held else self._admit(seq, seeds.get(seq.seq_id, 0), batch.resets)
            slots[i] = slot
            table, have = seq.block_table, self.num_blocks[slot]
            # Tables grow while a sequence holds its slot, and lose trailing pages when
            # rejected drafts give theirs back (`table_cuts`), which may then grow again
            # with other pages: rewrite the copy whole after a cut.
            same = have
            if seq.table_cuts != self.table_cuts[slot]:
                same, self.table_cuts[slot] = 0, seq.table_cuts
            if len(table) != same or same != have:
                self.page_tables[slot, same:len(table)] = table[same:]
                self.page_tables[slot, len(table):have] = 0
                self.num_blocks[slot] = len(table)
        n_new = np.fromiter((e.num_new_tokens for e in entries), np.int32, num_seqs)
        starts = np.fromiter((e.start for e in entries), np.int32, num_seqs)
        samples = np.fromiter((e.samples for e in entries), bool, num_seqs)
        ends = np.cumsum(n_new, dtype=np.int32)

        # token rows
        rows = np.arange(num_tokens, dtype=np.int32)
        seq_of_row = np.repeat(np.arange(num_seqs, dtype=np.int32), n_new)
        positions = starts[seq_of_row] + rows - (ends - n_new)[seq_of_row]
        tokens = np.fromiter(itertools.chain.from_iterable(
            e.seq.token_ids[e.start:e.end] for e in entries), np.int32, num_tokens)
        pending = tokens == PENDING
        row_slots = slots[seq_of_row]
        bs = cfg.block_size
        v["tokens"][:num_tokens] = np.where(pending, 0, tokens)
        v["token_slot"][:num_tokens] = np.where(pending, row_slots, -1)
        v["positions"][:num_tokens] = positions
        v["token_seq"][:num_tokens] = seq_of_row
        v["slot_mapping"][:num_tokens] = (self.page_tables[row_slots, positions // bs] * bs
                                          + positions % bs)
        # attention metadata of the body's sequences
        v["query_start_loc"][1:num_seqs + 1] = ends
        v["query_start_loc"][num_seqs + 1:] = num_tokens
        v["kv_lens"][:num_seqs] = starts + n_new
        v["page_tables"][:num_seqs] = self.page_tables[slots]

        # head rows: an entry's last token, and before it one per draft (each row samples the
        # token after its position); rows that sample nothing use the spare slot
        per_entry = np.fromiter((e.num_rows for e in entries), np.int32, num_seqs)
        entry_of = np.repeat(np.arange(num_seqs, dtype=np.int32), per_entry)
        back = np.cumsum(per_entry)[entry_of] - 1 - np.arange(num_rows, dtype=np.int32)
        v["logits_indices"][:num_rows] = ends[entry_of] - 1 - back
        rs = np.where(samples, slots, self.spare)[entry_of]
        # index of the token each row draws: the same key as a plain decode drawing it
        steps = (starts + n_new)[entry_of] - back - self.prompt_lens[rs]
        ints, layout = batch.sampling_ints, sampling_layout()
        batch.sampling_floats[:len(FLOAT_COLUMNS), :num_rows] = self.floats[:, rs]
        for name, col in (("top_k", self.top_k[rs]),
                          ("steps", np.where(samples[entry_of], steps, 0)),
                          ("num_top_logprobs", self.num_top_logprobs[rs]), ("slots", rs),
                          ("constrained", self.constrained[rs])):
            ints[layout[name][0], :num_rows] = col
        r = layout["seeds"][0]
        ints[r:r + 2, :num_rows] = self.seeds[rs].view(np.int32).T
        r = layout["banned_tokens"][0]
        early = (steps < self.min_tokens[rs])[:, None]
        ints[r:r + MAX_BANNED, :num_rows] = np.where(early, self.banned[rs], -1).T
        if (self.bias_ids[rs, 0] >= 0).any():  # the template's columns are "no bias"
            r = layout["logit_bias_ids"][0]
            ints[r:r + MAX_LOGIT_BIAS, :num_rows] = self.bias_ids[rs].T
            r = float_layout()["logit_bias"][0]
            batch.sampling_floats[r:r + MAX_LOGIT_BIAS, :num_rows] = self.biases[rs].T
        return batch
