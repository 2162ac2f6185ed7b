"""Batch building and the bucket table on their own (pure Python + numpy, no model): what the
device is handed for a scheduled step."""

from __future__ import annotations

import numpy as np
import pytest

from engine.batch import MAX_BANNED, build_batch, empty_batch
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence

EOS = 2
CFG = EngineConfig(model="", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                   block_size=4, num_blocks=65)


def entry(tokens: list[int], blocks: list[int], start: int, n: int, **params) -> ScheduledSeq:
    s = Sequence(tokens, SamplingParams(**params), CFG.block_size)  # all prompt, by default
    s.block_table = list(blocks)
    return ScheduledSeq(s, n, start)


def test_buckets_are_one_body_per_token_count_and_one_head_per_sequence_count():
    assert CFG.token_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert CFG.seq_buckets == (1, 2, 4, 8)
    assert CFG.buckets() == [("tokens", t) for t in CFG.token_buckets] + [
        ("seqs", s) for s in CFG.seq_buckets]
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
    batch = build_batch(CFG, SchedulerOutput([decode, prefill], []), seeds={})
    assert batch.bucket == (8, 2) and batch.num_seqs == 2
    np.testing.assert_array_equal(batch.tokens, [109, 204, 205, 206, 207, 208, 209, 0])
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


def test_banned_ids_hold_eos_and_stop_tokens_until_min_tokens():
    early = entry([10, 11, 12], [1], start=2, n=1, min_tokens=3, stop_token_ids=(5, 6))
    early.seq.num_prompt_tokens = 2  # one output token so far
    done = entry([10, 11, 12, 13], [2], start=3, n=1, min_tokens=1, stop_token_ids=(5,))
    done.seq.num_prompt_tokens = 2
    no_eos = entry([10, 11], [3], start=1, n=1, min_tokens=4, ignore_eos=True,
                   stop_token_ids=(9,))
    batch = build_batch(CFG, SchedulerOutput([early, done, no_eos], []), seeds={},
                        eos_token_ids=frozenset({EOS}))
    banned = batch.sampling["banned_tokens"]
    assert banned.shape == (4, MAX_BANNED)
    assert sorted(banned[0][banned[0] >= 0]) == [EOS, 5, 6]
    assert not (banned[1] >= 0).any()            # min_tokens reached: nothing banned
    assert sorted(banned[2][banned[2] >= 0]) == [9]  # ignore_eos: EOS may be picked later


def test_sampling_rows_carry_each_requests_parameters_and_seed():
    a = entry([1, 2], [1], start=1, n=1, temperature=0.7, top_k=5, top_p=0.9, seed=3)
    b = entry([1, 2], [2], start=1, n=1, presence_penalty=0.5)
    batch = build_batch(CFG, SchedulerOutput([a, b], []),
                        seeds={a.seq.seq_id: (7 << 32) | 9, b.seq.seq_id: 1})
    s = batch.sampling
    assert s["temperature"][0] == pytest.approx(0.7) and s["top_k"][0] == 5
    np.testing.assert_array_equal(s["seeds"], [[7, 9], [0, 1]])
    # penalties need the row's tokens; rows without penalties send none
    np.testing.assert_array_equal(s["prompt_tokens"][1, :3], [1, 2, -1])
    assert (s["prompt_tokens"][0] == -1).all()


def test_an_empty_batch_is_all_padding():
    batch = empty_batch(CFG, (16, 4))
    assert batch.num_seqs == 0 and (batch.token_seq == -1).all()
    assert not batch.slot_mapping.any() and not batch.page_tables.any()
    assert batch.query_start_loc.shape == (9,) and batch.logits_indices.shape == (8,)
