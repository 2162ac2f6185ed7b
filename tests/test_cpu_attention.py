"""xlaserve's CPU attention kernel (ops/native/attention.cc) against the pure-JAX reference
and the float64 oracle: every case of the kernel matrix, windows, soft caps, long contexts,
prefill chunks longer than one work item, batches large enough to use XLA's threads, inside
a jitted scan over layers, and what it refuses."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    LAYER,
    MATRIX_PARAMS,
    NUM_LAYERS,
    Case,
    case_from,
    case_of,
    check_kernel,
    make_case,
    oracle,
    rel_err,
)

from ops import native
from ops.attention import resolve_backend
from ops.cpu_attention import cpu_ragged_paged_attention as kernel
from ops.kv_cache import KVCache, quantize_kv

pytestmark = pytest.mark.skipif(not native.available("attention"),
                                reason=f"CPU kernel unavailable: {native.reason('attention')}")


def _case(seqs, *, group=3, num_kv_heads=3, head_dim=64) -> Case:
    return case_of(seqs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                   page_size=16)


@pytest.mark.parametrize("params", MATRIX_PARAMS)
def test_matches_reference(params):
    check_kernel(kernel, case_from(params))


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 40])
def test_sliding_window(sliding_window):
    check_kernel(kernel, _case([(1, 70), (37, 90), (1, 3), (0, 0)]),
                 sliding_window=sliding_window)


def test_soft_cap_and_window():
    check_kernel(kernel, make_case("mixed", num_kv_heads=2, group=4, head_dim=64,
                                   page_size=16), soft_cap=5.0, sliding_window=8)


def test_long_contexts_chunks_of_many_items_and_threads():
    """~600 keys, a 70-row chunk (several work items of rows per KV head) and 64 decodes:
    enough query-key pairs that XLA's pool threads share the items."""
    rng = np.random.default_rng(3)
    seqs = [(1, 600), (70, 577), (1, 33)] + [(1, int(n)) for n in rng.integers(1, 300, 64)]
    check_kernel(kernel, _case(seqs + [(0, 0)]))


@pytest.mark.parametrize("num_kv_heads, group", [(3, 3), (2, 8), (4, 1)])
def test_a_few_rows_take_every_kv_head_in_one_item(num_kv_heads, group):
    """A sequence whose rows times query heads fit one work item (48 query vectors) is one
    item over all its KV heads (decodes, a few drafted rows); one with more rows is split
    per KV head and block of rows. Both sides of that line, next to each other, with key
    blocks that some rows see only in part and 1 to 6 query vectors per KV head."""
    per_item = 48 // (num_kv_heads * group)  # the most rows of an all-heads item
    seqs = [(1, 17), (per_item, 40), (per_item + 1, 41), (2, 2), (1, 1), (0, 0)]
    check_kernel(kernel, _case(seqs, num_kv_heads=num_kv_heads, group=group))


@pytest.mark.parametrize("kv_len, window, cap", [(600, None, None), (1000, 100, None),
                                                 (130, None, 5.0), (129, 16, None)])
def test_a_rows_output_does_not_depend_on_the_other_sequences(kv_len, window, cap):
    """Without splitting (--batch-invariant), a long decode alone in its step (fewer work
    items than XLA's threads) and the same decode beside a prefill chunk and another decode
    give the same bits; split, alone, it is cut by keys over the threads and its parts'
    softmax states combined, and is right either way (with a window, some parts see no
    key at all)."""
    case = _case([(1, kv_len), (20, 40), (1, 20), (0, 0)])
    md = case.md
    lone = Case(case.q, case.cache, dataclasses.replace(
        md, query_start_loc=md.query_start_loc[:2], kv_lens=md.kv_lens[:1],
        page_tables=md.page_tables[:1]), [(1, kv_len), (0, 0)])
    kw = dict(sm_scale=case.q.shape[-1] ** -0.5, sliding_window=window, soft_cap=cap,
              split=False)
    alone = np.asarray(kernel(lone.q, lone.cache, LAYER, lone.md, **kw))
    beside = np.asarray(kernel(case.q, case.cache, LAYER, case.md, **kw))
    assert alone[0].tobytes() == beside[0].tobytes()
    for split in (True, False):
        check_kernel(kernel, _case([(1, kv_len), (0, 0)]), sliding_window=window,
                     soft_cap=cap, blocks={"split": split})


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("rows, num_kv_heads, group", [(5, 3, 3), (2, 2, 8), (20, 3, 3)])
def test_a_row_is_the_same_bits_alone_or_last_of_a_chunk(rows, num_kv_heads, group, kv_dtype):
    """A row that is a lone decode in one sequence and the last of `rows` in another, over
    the same pages and with the same query, gives the same bits: a drafting step's rows
    verify exactly what a decode would sample (the greedy tokens with and without drafting
    are the same), whether the chunk is one work item over every KV head (a few rows) or
    items of one KV head each (20 rows)."""
    kv_len = 300
    case = _case([(rows, kv_len), (1, kv_len), (0, 0)], num_kv_heads=num_kv_heads, group=group)
    q = case.q.at[rows].set(case.q[rows - 1])  # the lone row asks what the chunk's last does
    md = case.md
    tables = md.page_tables.at[1].set(md.page_tables[0])  # ... of the same keys
    md = dataclasses.replace(md, page_tables=tables)
    cache = case.cache
    if kv_dtype == "int8":
        (k, ks), (v, vs) = quantize_kv(cache.k), quantize_kv(cache.v)
        cache = KVCache(k, v, ks, vs)
    elif kv_dtype != "float32":
        cache = KVCache(cache.k.astype(kv_dtype), cache.v.astype(kv_dtype))
    out = np.asarray(kernel(q, cache, LAYER, md, sm_scale=0.125, split=False))
    assert out[rows].tobytes() == out[rows - 1].tobytes()
    assert np.abs(out[rows]).max() > 0


@pytest.mark.parametrize("page_size", [1, 4, 8, 32])
def test_pages_smaller_and_larger_than_a_block_of_keys(page_size):
    """The kernel reads keys 16 at a time and walks their pages by counting: pages that end
    inside a block (1, 4, 8 tokens) and blocks that start inside a page (32)."""
    seqs = [(1, 70), (13, 45), (1, 1), (1, 33), (0, 0)]
    check_kernel(kernel, case_of(seqs, num_kv_heads=3, group=3, head_dim=64,
                                 page_size=page_size, seed=page_size))


@pytest.mark.parametrize("head_dim, group", [(128, 4), (256, 1), (80, 8), (64, 16)])
def test_head_dims_and_groups_of_other_models(head_dim, group):
    check_kernel(kernel, _case([(1, 40), (21, 50), (0, 0)], head_dim=head_dim, group=group,
                               num_kv_heads=1))


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_pages_in_their_dtype(kv_dtype):
    case = _case([(1, 100), (20, 20), (3, 50), (0, 0)])
    low = KVCache(case.cache.k.astype(kv_dtype), case.cache.v.astype(kv_dtype))
    widened = KVCache(low.k.astype(jnp.float32), low.v.astype(jnp.float32))
    out = kernel(case.q, low, LAYER, case.md, sm_scale=0.125)
    assert rel_err(out, oracle(case.q, widened, LAYER, case.md, sm_scale=0.125)) < 1e-5


def test_in_a_jitted_scan_over_layers_with_writes():
    """As the model calls it: each layer writes its K/V, then reads the pool it just wrote,
    the layer a traced index."""
    from ops.kv_cache import write_kv
    from ops.reference_attention import ref_ragged_paged_attention

    case = _case([(1, 40), (9, 30), (0, 0)])
    rng = np.random.default_rng(1)
    new = jnp.asarray(rng.standard_normal((NUM_LAYERS, 2, *case.q.shape[:1],
                                           *case.cache.k.shape[3:])), jnp.float32)

    def run(attend, cache):
        def layer(cache, idx):
            cache = write_kv(cache, idx, new[idx, 0], new[idx, 1], case.md.slot_mapping)
            return cache, attend(case.q, cache, idx, case.md, sm_scale=0.125)
        return jax.lax.scan(layer, cache, jnp.arange(NUM_LAYERS, dtype=jnp.int32))

    got_cache, got = jax.jit(lambda c: run(kernel, c))(case.cache)
    want_cache, want = jax.jit(lambda c: run(ref_ragged_paged_attention, c))(case.cache)
    np.testing.assert_array_equal(np.asarray(got_cache.k), np.asarray(want_cache.k))
    assert rel_err(got, want) < 1e-5


def test_refusals():
    case = _case([(1, 20), (0, 0)], head_dim=72)
    with pytest.raises(ValueError, match="head_dim a multiple of 16"):
        kernel(case.q, case.cache, LAYER, case.md, sm_scale=0.125)
    case = _case([(1, 20), (0, 0)])
    fp8 = KVCache(case.cache.k.astype(jnp.float8_e4m3fn), case.cache.v.astype(jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="reads pages of"):
        kernel(case.q, fp8, LAYER, case.md, sm_scale=0.125)
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(kernel(case.q, case.cache, NUM_LAYERS, case.md, sm_scale=0.125))


def test_auto_is_the_kernel_on_cpu():
    assert resolve_backend("auto", jax.devices("cpu")[0]) == "cpu"
