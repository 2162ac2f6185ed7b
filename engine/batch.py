"""Batch building: one scheduled step -> numpy arrays padded to a bucket.

The only shapes the device ever sees come from `EngineConfig.bucket_for`, shared
with warmup. Padded token rows write their K/V to the reserved page 0; padded
sequences have no query rows, zero KV length and an all-page-0 table.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.config import EngineConfig
from engine.scheduler import SchedulerOutput

# Ids a row can be kept from picking (EOS + stop token ids before min_tokens); equals
# ops.sampling.MAX_BANNED, which this bookkeeping module may not import.
MAX_BANNED = 16


@dataclasses.dataclass
class StepBatch:
    """One step's inputs. The model body sees the token rows (T) and the attention metadata of
    `config.body_seqs(T)` sequences; the LM head and sampler see S sampling rows."""

    bucket: tuple[int, int]        # (tokens T, sequences S)
    num_seqs: int                  # real sequences (rows past it are padding)
    # model body inputs
    tokens: np.ndarray             # [T] int32
    positions: np.ndarray          # [T] int32
    token_seq: np.ndarray          # [T] int32: each row's sequence, -1 for padding
    slot_mapping: np.ndarray       # [T] int32
    query_start_loc: np.ndarray    # [Sb + 1] int32
    kv_lens: np.ndarray            # [Sb] int32
    page_tables: np.ndarray        # [Sb, max_blocks_per_seq] int32
    logits_indices: np.ndarray     # [max_num_seqs] int32: each sequence's last row in this step
    # sampling, one row per sequence: [S, ...]
    sampling: dict[str, np.ndarray]

    @property
    def body_inputs(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in (
            "tokens", "positions", "token_seq", "slot_mapping", "query_start_loc", "kv_lens",
            "page_tables", "logits_indices")}


def sampling_arrays(num_seqs: int, width: int) -> dict[str, np.ndarray]:
    """Neutral sampling rows (greedy, no penalties) for padding and warmup."""
    return {
        "temperature": np.zeros(num_seqs, np.float32),
        "top_k": np.zeros(num_seqs, np.int32),
        "top_p": np.ones(num_seqs, np.float32),
        "min_p": np.zeros(num_seqs, np.float32),
        "presence_penalty": np.zeros(num_seqs, np.float32),
        "frequency_penalty": np.zeros(num_seqs, np.float32),
        "repetition_penalty": np.ones(num_seqs, np.float32),
        "seeds": np.zeros((num_seqs, 2), np.uint32),
        "steps": np.zeros(num_seqs, np.int32),
        "output_tokens": np.full((num_seqs, width), -1, np.int32),
        "prompt_tokens": np.full((num_seqs, width), -1, np.int32),
        "num_top_logprobs": np.zeros(num_seqs, np.int32),
        "banned_tokens": np.full((num_seqs, MAX_BANNED), -1, np.int32),
    }


def empty_batch(config: EngineConfig, bucket: tuple[int, int]) -> StepBatch:
    """An all-padding batch of a bucket's shape (warmup runs these)."""
    t, s = bucket
    sb = config.body_seqs(t)
    return StepBatch(
        bucket=bucket, num_seqs=0,
        tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
        token_seq=np.full(t, -1, np.int32),
        slot_mapping=np.zeros(t, np.int32), query_start_loc=np.zeros(sb + 1, np.int32),
        kv_lens=np.zeros(sb, np.int32),
        page_tables=np.zeros((sb, config.max_blocks_per_seq), np.int32),
        logits_indices=np.zeros(config.max_num_seqs, np.int32),
        sampling=sampling_arrays(s, config.max_model_len),
    )


def build_batch(config: EngineConfig, out: SchedulerOutput, seeds: dict[int, int],
                eos_token_ids: frozenset[int] = frozenset()) -> StepBatch:
    """`seeds` maps seq_id -> the 64-bit seed of its sampling stream."""
    entries = out.scheduled
    batch = empty_batch(config, config.bucket_for(out.num_tokens, len(entries)))
    batch.num_seqs = len(entries)
    bs = config.block_size
    row = 0
    for i, e in enumerate(entries):
        seq, n = e.seq, e.num_new_tokens
        pos = np.arange(e.start, e.start + n, dtype=np.int32)
        table = np.asarray(seq.block_table, np.int32)
        batch.tokens[row:row + n] = seq.token_ids[e.start:e.start + n]
        batch.positions[row:row + n] = pos
        batch.token_seq[row:row + n] = i
        batch.slot_mapping[row:row + n] = table[pos // bs] * bs + pos % bs
        batch.page_tables[i, :len(table)] = table
        batch.kv_lens[i] = e.start + n
        row += n
        batch.query_start_loc[i + 1] = row
        batch.logits_indices[i] = row - 1
        _fill_sampling(batch.sampling, i, seq, seeds.get(seq.seq_id, 0), eos_token_ids)
    batch.query_start_loc[len(entries) + 1:] = row
    return batch


def _fill_sampling(arrays: dict[str, np.ndarray], i: int, seq, seed: int,
                   eos_token_ids: frozenset[int]) -> None:
    p = seq.params
    if seq.num_output_tokens < p.min_tokens:  # EOS and stop tokens may not end it yet
        banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids))
        banned = banned[:MAX_BANNED]
        arrays["banned_tokens"][i, :len(banned)] = banned
    arrays["temperature"][i] = p.temperature
    arrays["top_k"][i] = p.top_k
    arrays["top_p"][i] = p.top_p
    arrays["min_p"][i] = p.min_p
    arrays["presence_penalty"][i] = p.presence_penalty
    arrays["frequency_penalty"][i] = p.frequency_penalty
    arrays["repetition_penalty"][i] = p.repetition_penalty
    arrays["seeds"][i] = (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF
    arrays["steps"][i] = seq.num_output_tokens
    arrays["num_top_logprobs"][i] = p.logprobs or 0
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        out = seq.output_token_ids
        arrays["output_tokens"][i, :len(out)] = out
        arrays["prompt_tokens"][i, :seq.num_prompt_tokens] = seq.token_ids[:seq.num_prompt_tokens]
