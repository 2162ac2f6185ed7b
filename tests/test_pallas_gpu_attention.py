"""The Pallas GPU ragged paged attention kernel, interpreted on CPU, against the reference."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ops.attention import AttentionMetadata, KVCache, ref_ragged_paged_attention
from ops.pallas_gpu_attention import pallas_gpu_ragged_paged_attention

PAGE_SIZE = 16
NUM_LAYERS = 2
NUM_PAGES = 16
# (q_len, kv_len) per sequence: a decode token; a prefill chunk ending exactly on a page
# boundary; a chunk one token past a boundary; a first-chunk prefill; a padded empty one.
SEQS = [(1, 5), (16, 32), (3, 33), (7, 7), (0, 0)]
NUM_TOKENS = 32  # 27 real rows, 5 padded ones


def _metadata(rng) -> AttentionMetadata:
    q_lens = [q for q, _ in SEQS]
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    max_pages = 4
    free = list(rng.permutation(np.arange(1, NUM_PAGES)))  # page 0 is the dummy page
    page_tables = np.zeros((len(SEQS), max_pages), np.int32)
    for s, (_, kv_len) in enumerate(SEQS):
        for j in range(-(-kv_len // PAGE_SIZE)):
            page_tables[s, j] = free.pop()
    return AttentionMetadata(
        slot_mapping=jnp.zeros(NUM_TOKENS, jnp.int32),
        query_start_loc=jnp.asarray(query_start_loc),
        kv_lens=jnp.asarray([kv for _, kv in SEQS], jnp.int32),
        page_tables=jnp.asarray(page_tables),
    )


def _case(num_kv_heads, group, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    shape = (NUM_LAYERS, NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim)
    cache = KVCache(jnp.asarray(rng.standard_normal(shape), jnp.float32),
                    jnp.asarray(rng.standard_normal(shape), jnp.float32))
    q = jnp.asarray(rng.standard_normal((NUM_TOKENS, num_kv_heads * group, head_dim)),
                    jnp.float32)
    return q, cache, _metadata(rng)


def _check(q, cache, md, **kw):
    sm_scale = q.shape[-1] ** -0.5
    out = pallas_gpu_ragged_paged_attention(q, cache, 1, md, sm_scale=sm_scale,
                                            interpret=True, **kw)
    ref = ref_ragged_paged_attention(q, cache, 1, md, sm_scale=sm_scale, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not np.isnan(np.asarray(out)).any()
    rel = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    assert rel < 1e-5, rel
    num_real = int(md.query_start_loc[-1])
    np.testing.assert_array_equal(np.asarray(out[num_real:]), 0.0)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference(group, head_dim):
    _check(*_case(num_kv_heads=2, group=group, head_dim=head_dim))


@pytest.mark.parametrize("sliding_window", [1, 5, 16])
def test_sliding_window(sliding_window):
    _check(*_case(num_kv_heads=2, group=4, head_dim=64), sliding_window=sliding_window)


def test_soft_cap():
    _check(*_case(num_kv_heads=1, group=4, head_dim=64), soft_cap=2.0)


def test_soft_cap_and_window():
    _check(*_case(num_kv_heads=2, group=1, head_dim=64), soft_cap=5.0, sliding_window=8)


def test_default_interpret_on_cpu():
    q, cache, md = _case(num_kv_heads=1, group=2, head_dim=64)
    out = pallas_gpu_ragged_paged_attention(q, cache, 0, md, sm_scale=0.125)
    ref = ref_ragged_paged_attention(q, cache, 0, md, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad, match", [
    (lambda q, c, md: (q[:, :3], c, md), "not divisible"),
    (lambda q, c, md: (q.astype(jnp.bfloat16), c, md), "dtypes must match"),
    (lambda q, c, md: (q, c, dataclasses.replace(md, page_tables=md.page_tables.astype(jnp.int16))),
     "int32"),
    (lambda q, c, md: (q[..., :48], KVCache(c.k[..., :48], c.v[..., :48]), md),
     "power of two"),
    (lambda q, c, md: (q[..., :32], c, md), "head_dim"),
    (lambda q, c, md: (q[0], c, md), r"\[T, H, D\]"),
])
def test_bad_inputs_raise(bad, match):
    q, cache, md = bad(*_case(num_kv_heads=2, group=2, head_dim=64))
    with pytest.raises(ValueError, match=match):
        pallas_gpu_ragged_paged_attention(q, cache, 0, md, sm_scale=0.125)
