"""Batch building and the bucket table on their own (pure Python + numpy, no model): what the
device is handed for a scheduled step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.batch import MAX_BANNED, InputBatch, body_layout, empty_batch
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import PENDING, Sequence, SequenceStatus

EOS = 2
CFG = EngineConfig(model="", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                   block_size=4, num_blocks=65)


def entry(tokens: list[int], blocks: list[int], start: int, n: int, prompt: int | None = None,
          **params) -> ScheduledSeq:
    """A running sequence booked for a step of n tokens from `start` (all prompt by default)."""
    s = Sequence(tokens[:prompt], SamplingParams(**params), CFG.block_size)
    s.token_ids = list(tokens)
    s.block_table = list(blocks)
    s.status = SequenceStatus.RUNNING
    return ScheduledSeq(s, n, start, samples=start + n == len(tokens))


def build(*entries: ScheduledSeq, batch: InputBatch | None = None, seeds=None):
    batch = batch or InputBatch(CFG, frozenset({EOS}))
    return batch.build(SchedulerOutput(list(entries), []), seeds or {}), batch


def test_buckets_are_one_body_per_token_count_and_one_head_per_sequence_count():
    assert CFG.token_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert CFG.seq_buckets == (1, 2, 4, 8)
    assert CFG.step_buckets == (1,)  # a lone decode: body and head in one
    for k, fused in ((1, (1, 2)), (4, (1, 2, 4)), (7, (1, 2, 4, 8))):  # and its drafting step
        spec = {"method": "ngram", "num_speculative_tokens": k}
        assert dataclasses.replace(CFG, speculative=spec).step_buckets == fused
    assert CFG.buckets() == [("tokens", t) for t in CFG.token_buckets] + [
        ("seqs", s) for s in CFG.seq_buckets] + [("step", 1), ("penalties", 1)]
    assert CFG.bucket_for(1, 1) == (1, 1)       # a lone decode is one row, not 16
    assert CFG.bucket_for(3, 3) == (4, 4)
    assert CFG.bucket_for(40, 3) == (64, 4)
    assert CFG.body_seqs(4) == 4 and CFG.body_seqs(64) == 8
    odd = EngineConfig(model="", max_num_seqs=48, max_num_batched_tokens=300)
    assert odd.token_buckets[-2:] == (256, 300) and odd.seq_buckets[-2:] == (32, 48)
    for tokens, seqs in [(65, 1), (8, 9), (2, 3)]:
        with pytest.raises(ValueError, match="outside the bucket table"):
            CFG.bucket_for(tokens, seqs)


def test_a_mixed_step_lays_out_rows_slots_and_page_tables():
    # A decode at position 9 (blocks 5, 6, 7) and a 6-token prefill chunk from position 4
    # (blocks 3, 8): rows, slots and tables as the attention reads them.
    decode = entry(list(range(100, 110)), [5, 6, 7], start=9, n=1)
    prefill = entry(list(range(200, 212)), [3, 8, 11], start=4, n=6)
    batch, _ = build(decode, prefill)
    assert batch.bucket == (8, 2) and batch.num_rows == 2
    np.testing.assert_array_equal(batch.tokens, [109, 204, 205, 206, 207, 208, 209, 0])
    np.testing.assert_array_equal(batch.token_slot, [-1] * 8)  # every token known here
    np.testing.assert_array_equal(batch.positions, [9, 4, 5, 6, 7, 8, 9, 0])
    np.testing.assert_array_equal(batch.token_seq, [0, 1, 1, 1, 1, 1, 1, -1])
    # page * 4 + offset; the padded row writes to page 0
    np.testing.assert_array_equal(batch.slot_mapping, [7 * 4 + 1, 8 * 4, 8 * 4 + 1, 8 * 4 + 2,
                                                       8 * 4 + 3, 11 * 4, 11 * 4 + 1, 0])
    # body metadata for body_seqs(8) = 8 sequences, the padded ones empty and on page 0
    np.testing.assert_array_equal(batch.query_start_loc, [0, 1, 7, 7, 7, 7, 7, 7, 7])
    np.testing.assert_array_equal(batch.kv_lens, [10, 10, 0, 0, 0, 0, 0, 0])
    assert batch.page_tables.shape == (8, CFG.max_blocks_per_seq)
    np.testing.assert_array_equal(batch.page_tables[:2, :4], [[5, 6, 7, 0], [3, 8, 11, 0]])
    assert not batch.page_tables[2:].any()
    # each sequence's last row, padded to max_num_seqs; sampling rows for the S bucket
    np.testing.assert_array_equal(batch.logits_indices, [0, 6, 0, 0, 0, 0, 0, 0])
    assert all(len(v) == 2 for v in batch.sampling.values())
    # the decode samples on its slot; the mid-prompt chunk samples nothing (the spare slot)
    np.testing.assert_array_equal(batch.sampling["slots"], [0, CFG.max_num_seqs])


def test_the_named_inputs_are_views_of_two_buffers_laid_out_once():
    batch = empty_batch(CFG, (16, 4))
    layout = body_layout(CFG, 16)
    for name, (offset, shape) in layout.items():
        view = getattr(batch, name)
        assert view.shape == shape and np.shares_memory(view, batch.body)
        assert view.__array_interface__["data"][0] == (batch.body.__array_interface__["data"][0]
                                                       + 4 * offset)
    assert batch.body.size == max(o + int(np.prod(s)) for o, s in layout.values())
    assert batch.sampling_ints.shape[1] == batch.sampling_floats.shape[1] == 4


def test_slots_persist_and_a_pending_token_is_read_on_the_device():
    a = entry([1, 2, 3], [4], start=0, n=3, temperature=0.5)
    batch, ib = build(a)
    assert batch.sampling["slots"][0] == 0 and not batch.resets
    a.seq.append_pending()                           # the scheduler booked the first token
    b = entry([7, 8], [6], start=0, n=2)
    step2 = ScheduledSeq(a.seq, 1, 3, samples=True)  # a decodes its pending token
    a.seq.append_pending()
    batch, _ = build(step2, b, batch=ib)
    np.testing.assert_array_equal(batch.tokens[:3], [0, 7, 8])
    np.testing.assert_array_equal(batch.token_slot[:3], [0, -1, -1])  # slot 0's last token
    np.testing.assert_array_equal(batch.sampling["slots"], [0, 1])
    assert batch.sampling["temperature"][0] == pytest.approx(0.5)
    np.testing.assert_array_equal(batch.sampling["steps"], [1, 0])  # index of the drawn token
    assert a.seq.token_ids[3:] == [PENDING, PENDING]
    # a finishes: its slot is free for the next sequence, whose table replaces a's
    a.seq.status = SequenceStatus.FINISHED
    c = entry([9, 9, 9, 9, 9], [12, 13], start=0, n=5)
    batch, _ = build(c, batch=ib)
    assert batch.sampling["slots"][0] == 0
    np.testing.assert_array_equal(ib.page_tables[0, :3], [12, 13, 0])


def test_banned_ids_hold_eos_and_stop_tokens_until_min_tokens():
    # one output token so far in each: the token drawn now is output index 1
    early = entry([10, 11, 12], [1], start=2, n=1, prompt=2, min_tokens=3, stop_token_ids=(5, 6))
    done = entry([10, 11, 12], [2], start=2, n=1, prompt=2, min_tokens=1, stop_token_ids=(5,))
    no_eos = entry([10, 11, 12], [3], start=2, n=1, prompt=2, min_tokens=4, ignore_eos=True,
                   stop_token_ids=(9,))
    batch, _ = build(early, done, no_eos)
    banned = batch.sampling["banned_tokens"]
    assert banned.shape == (4, MAX_BANNED)
    assert sorted(banned[0][banned[0] >= 0]) == [EOS, 5, 6]
    assert not (banned[1] >= 0).any()            # min_tokens reached: nothing banned
    assert sorted(banned[2][banned[2] >= 0]) == [9]  # ignore_eos: EOS may be picked later
    assert not (banned[3] >= 0).any()            # padding


def test_sampling_rows_carry_each_requests_parameters_and_seed():
    a = entry([1, 2], [1], start=1, n=1, temperature=0.7, top_k=5, top_p=0.9, seed=3)
    b = entry([1, 2, 3, 4], [2], start=3, n=1, prompt=2, presence_penalty=0.5)
    batch, _ = build(a, b, seeds={a.seq.seq_id: (7 << 32) | 9, b.seq.seq_id: 1})
    s = batch.sampling
    assert s["temperature"][0] == pytest.approx(0.7) and s["top_k"][0] == 5
    assert s["presence_penalty"][1] == pytest.approx(0.5)
    np.testing.assert_array_equal(s["seeds"], [[7, 9], [0, 1]])
    # penalties are counted on the device per slot: only b's slot starts from its tokens
    [(slot, prompt, output)] = batch.resets
    assert slot == 1 and list(prompt) == [1, 2] and list(output) == [3, 4]


def test_an_empty_batch_is_all_padding():
    batch = empty_batch(CFG, (16, 4))
    assert batch.num_rows == 0 and (batch.token_seq == -1).all()
    assert not batch.slot_mapping.any() and not batch.page_tables.any()
    assert batch.query_start_loc.shape == (9,) and batch.logits_indices.shape == (8,)
    assert (batch.sampling["slots"] == CFG.max_num_seqs).all()
