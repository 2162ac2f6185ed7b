"""The reference attention reads what the step needs and nothing past it: page-table columns
beyond the step's longest history, and pages no sequence owns, are never touched, however
wide the table (`max_model_len`) or large the pool (`num_pages`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import LAYER, oracle, rel_err

from ops.attention import AttentionMetadata, row_layout
from ops.kv_cache import KVCache
from ops.reference_attention import history_block, ref_ragged_paged_attention

PAGE = 16


def _poisoned_case(width: int, extra_pages: int, seed: int = 0):
    """Decodes and a prefill chunk with history over pages in random order. Page-table
    columns past the first block of keys the reference reads (`history_block`: 80 keys, 5
    pages, for this step's 12 rows) point at a page of NaNs, and the pool has `extra_pages`
    more NaN pages nobody owns; unused columns inside that block point at page 0, as the
    engine's do."""
    rng = np.random.default_rng(seed)
    seqs = [(1, 40), (1, 17), (6, 30), (1, 1)]  # (q_len, kv_len)
    used = [-(-kv // PAGE) for _, kv in seqs]
    num_pages = 2 + sum(used) + extra_pages  # page 0, the NaN page, the real ones, the rest
    nan_page = 1
    real = list(rng.permutation(np.arange(2, 2 + sum(used))))
    num_tokens = sum(q for q, _ in seqs) + 3
    _, block_keys = history_block(num_tokens, PAGE)
    assert max(kv for _, kv in seqs) <= block_keys < 128 * PAGE
    tables = np.full((len(seqs), width), nan_page, np.int32)
    tables[:, :block_keys // PAGE] = 0
    for s, n in enumerate(used):
        tables[s, :n] = [real.pop() for _ in range(n)]
    shape = (2, num_pages, PAGE, 2, 64)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[:, nan_page] = v[:, nan_page] = np.nan
    k[:, 2 + sum(used):] = v[:, 2 + sum(used):] = np.nan
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    slots = np.zeros(num_tokens, np.int32)  # each row's own K/V, as write_kv put them
    row = 0
    for s, (q_len, kv) in enumerate(seqs):
        for pos in range(kv - q_len, kv):
            slots[row] = tables[s, pos // PAGE] * PAGE + pos % PAGE
            row += 1
    kv_lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    positions, token_seq = row_layout(jnp.asarray(qsl), kv_lens, num_tokens)
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots), query_start_loc=jnp.asarray(qsl),
                           kv_lens=kv_lens, page_tables=jnp.asarray(tables),
                           positions=positions, token_seq=token_seq)
    q = jnp.asarray(rng.standard_normal((num_tokens, 8, 64)), jnp.float32)
    return q, KVCache(jnp.asarray(k), jnp.asarray(v)), md


@pytest.mark.parametrize("width, extra_pages", [(4, 0), (128, 0), (128, 500)])
def test_nothing_past_the_real_lengths_is_read(width, extra_pages):
    # One block of keys covers every history here (the longest is 39), so with a table of
    # 128 columns (max_model_len 2048) a reader of the whole table would meet the NaN pages:
    # 0 * NaN is NaN, so any such read shows in the output.
    q, cache, md = _poisoned_case(width, extra_pages)
    out = ref_ragged_paged_attention(q, cache, LAYER, md, sm_scale=0.125)
    assert np.isfinite(np.asarray(out)).all()
    clean = KVCache(jnp.nan_to_num(cache.k), jnp.nan_to_num(cache.v))
    expected = oracle(q, clean, LAYER, md, sm_scale=0.125)
    assert rel_err(out, expected) < 1e-5


def test_the_poison_is_seen_when_it_is_needed():
    """Positive control: the same NaN page inside a sequence's keys does reach the output."""
    q, cache, md = _poisoned_case(128, 0)
    tables = md.page_tables.at[0, 1].set(1)  # sequence 0's second page -> the NaN page
    md = dataclasses.replace(md, page_tables=tables)
    out = np.asarray(ref_ragged_paged_attention(q, cache, LAYER, md, sm_scale=0.125))
    assert np.isnan(out[0]).any()
