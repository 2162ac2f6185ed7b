"""The Pallas TPU ragged paged attention kernel, in TPU interpret mode on CPU, against the
pure-JAX reference and the float64 oracle; float32, bfloat16, int8 (with their scales) and
fp8 pages."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    INTERPRETED_MATRIX_PARAMS,
    Case,
    case_from,
    check_kernel,
    make_case,
    reference,
)

from ops.kv_cache import KVCache, quantize_kv, read_kv
from ops.pallas_tpu_attention import pallas_tpu_ragged_paged_attention

kernel = functools.partial(pallas_tpu_ragged_paged_attention, interpret=True)


def _small_case(**kw):
    params = dict(num_kv_heads=2, group=4, head_dim=64, page_size=16, seed=7) | kw
    return make_case("mixed", **params)


@pytest.mark.parametrize("params", INTERPRETED_MATRIX_PARAMS)
def test_matches_reference(params):
    check_kernel(kernel, case_from(params))


@pytest.mark.parametrize("sliding_window", [1, 5, 16])
def test_sliding_window(sliding_window):
    check_kernel(kernel, _small_case(), sliding_window=sliding_window)


def test_soft_cap():
    check_kernel(kernel, _small_case(group=1), soft_cap=2.0)


def test_soft_cap_and_window():
    check_kernel(kernel, _small_case(dtype=jnp.bfloat16), soft_cap=5.0, sliding_window=8)


def _stored(cache: KVCache, kv_dtype: str) -> KVCache:
    """`cache`'s pages stored as `kv_dtype`: "int8" quantized per token and KV head with their
    scales (as `write_kv` stores them), "fp8" as e4m3 values."""
    if kv_dtype == "int8":
        (k, k_scale), (v, v_scale) = quantize_kv(cache.k), quantize_kv(cache.v)
        return KVCache(k, v, k_scale, v_scale)
    return KVCache(cache.k.astype(jnp.float8_e4m3fn), cache.v.astype(jnp.float8_e4m3fn))


def check_stored(case: Case, kv_dtype: str, blocks=None, **kw) -> None:
    """The kernel over `case`'s pages stored as `kv_dtype` against the reference over the same
    pages and the float64 oracle over the float32 values they stand for (int8 times its
    scales). `blocks`: the kernel's block sizes; `kw`: attention options for all three."""
    stored = _stored(case.cache, kv_dtype)
    values = KVCache(read_kv(stored.k, stored.k_scale, jnp.float32),
                     read_kv(stored.v, stored.v_scale, jnp.float32))
    check_kernel(kernel, dataclasses.replace(case, cache=stored), values=values, blocks=blocks,
                 **kw)


# 8-bit pages need page_size 32 (four values to a 32-bit sublane, 8 sublanes a tile).
@pytest.mark.parametrize("kv_dtype, kind, group, head_dim, dtype", [
    ("int8", "mixed", 4, 64, jnp.float32),     # prefill chunks and decodes, GQA
    ("int8", "decode", 8, 128, jnp.bfloat16),
    pytest.param("int8", "prefill", 1, 64, jnp.float32, marks=pytest.mark.slow),  # in mixed
    ("fp8", "mixed", 4, 64, jnp.bfloat16),
    ("fp8", "decode", 2, 128, jnp.float32),
])
def test_8bit_pages_match_reference(kv_dtype, kind, group, head_dim, dtype):
    case = make_case(kind, num_kv_heads=2, group=group, head_dim=head_dim, page_size=32,
                     dtype=dtype, seed=11)
    check_stored(case, kv_dtype)


# Each dtype once by default (int8 with skipped blocks); the other pairs under -m slow.
@pytest.mark.parametrize("kv_dtype, sliding_window", [
    ("int8", 5), ("fp8", 40), *(pytest.param(d, w, marks=pytest.mark.slow)
                                for d, w in [("int8", 40), ("fp8", 5)])])
def test_8bit_pages_sliding_window_small_blocks(kv_dtype, sliding_window):
    """A window over 8-bit pages, one page a block and two rows an item: the scale slabs
    alternate double-buffer slots with their pages, and blocks wholly before the window
    (window 5 over 32-token pages) are skipped."""
    case = make_case("mixed", num_kv_heads=2, group=2, head_dim=64, page_size=32, seed=5)
    check_stored(case, kv_dtype, blocks=dict(block_q=2, pages_per_block=1),
                 sliding_window=sliding_window, soft_cap=5.0)


@pytest.mark.parametrize("block_q, pages_per_block", [(2, 1), (4, 2)])
def test_small_blocks(block_q, pages_per_block):
    """Several work items per prefill sequence and several KV blocks per item, so the
    double-buffered page copies alternate slots (with a window, blocks are also skipped)."""
    small = functools.partial(kernel, block_q=block_q, pages_per_block=pages_per_block)
    check_kernel(small, _small_case(group=2), sliding_window=20)
    check_kernel(small, make_case("prefill", num_kv_heads=1, group=2, head_dim=64,
                                  page_size=16, seed=3))


def test_traced_layer_under_jit_and_scan():
    case = _small_case(group=2)
    sm_scale = 0.125
    expected = [reference(case.q, case.cache, layer, case.md, sm_scale=sm_scale)
                for layer in range(2)]
    assert float(jnp.max(jnp.abs(expected[0] - expected[1]))) > 0.1  # the layer matters

    @jax.jit
    def one_layer(layer):
        return kernel(case.q, case.cache, layer, case.md, sm_scale=sm_scale)

    def step(carry, layer):
        return carry, kernel(case.q, case.cache, layer, case.md, sm_scale=sm_scale)

    _, scanned = jax.lax.scan(step, 0, jnp.arange(2, dtype=jnp.int32))
    for layer in range(2):
        np.testing.assert_allclose(np.asarray(one_layer(layer)), np.asarray(expected[layer]),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(scanned[layer]), np.asarray(expected[layer]),
                                   rtol=1e-5, atol=1e-5)


def test_default_interpret_on_cpu():
    case = _small_case(group=1)  # test_soft_cap's shapes and statics: a compile-cache hit
    kw = dict(sm_scale=0.125, soft_cap=2.0)
    out = pallas_tpu_ragged_paged_attention(case.q, case.cache, 0, case.md, **kw)
    ref = reference(case.q, case.cache, 0, case.md, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, kv_dtype", [
    (jnp.float32, None), (jnp.bfloat16, None), (jnp.float32, "int8"), (jnp.bfloat16, "int8"),
    (jnp.bfloat16, "fp8"),
])
def test_lowers_to_mosaic(dtype, kv_dtype):
    """Without a TPU, lowering for one still runs Pallas's Mosaic lowering (not libtpu's
    compiler): it rejects constructs that only interpret mode accepts."""
    case = _small_case(dtype=dtype, page_size=16 if kv_dtype is None else 32)
    cache = case.cache if kv_dtype is None else _stored(case.cache, kv_dtype)
    attention = functools.partial(pallas_tpu_ragged_paged_attention, sm_scale=0.125,
                                  sliding_window=8, soft_cap=5.0, interpret=False,
                                  block_q=4, pages_per_block=2)
    exported = jax.export.export(jax.jit(attention), platforms=["tpu"])(
        case.q, cache, jnp.int32(1), case.md)
    assert "tpu_custom_call" in exported.mlir_module()


def _replace_md(**fields):
    return lambda q, c, md: (q, c, dataclasses.replace(md, **fields))


def _cast(dtype):
    return lambda q, c, md: (q.astype(dtype), KVCache(c.k.astype(dtype), c.v.astype(dtype)), md)


@pytest.mark.parametrize("bad, match", [
    (lambda q, c, md: (q[0], c, md), r"\[T, H, D\]"),
    (lambda q, c, md: (q, KVCache(c.k[0], c.v[0]), md), r"\[L, P, page, Hkv, D\]"),
    (lambda q, c, md: (q, KVCache(c.k, c.v[:, :-1]), md), r"\[L, P, page, Hkv, D\]"),
    (lambda q, c, md: (q[..., :32], c, md), "head_dim"),
    (lambda q, c, md: (q[:, :3], c, md), "not divisible"),
    (lambda q, c, md: (q, KVCache(c.k, c.v.astype(jnp.bfloat16)), md), "share a dtype"),
    (_cast(jnp.float16), "q dtype must be float32 or bfloat16"),
    (lambda q, c, md: (q, KVCache(c.k.astype(jnp.float16), c.v.astype(jnp.float16)), md),
     "float16 KV pages are not supported by the TPU kernel.*bfloat16"),
    (lambda q, c, md: (q, KVCache(c.k[:, :, :12], c.v[:, :, :12]), md), "multiple of 8"),
    (lambda q, c, md: (q[..., :32], KVCache(c.k[..., :32], c.v[..., :32]), md),
     "multiple of 64"),
    (_replace_md(page_tables=np.zeros((7, 4), np.int16)), "int32"),
    (_replace_md(kv_lens=jnp.zeros(6, jnp.int32)), "metadata shapes"),
    (_replace_md(page_tables=jnp.zeros((7, 300_000), jnp.int32)), "SMEM"),
])
def test_bad_inputs_raise(bad, match):
    case = _small_case(group=2)
    q, cache, md = bad(case.q, case.cache, case.md)
    with pytest.raises(ValueError, match=match):
        pallas_tpu_ragged_paged_attention(q, cache, 0, md, sm_scale=0.125)


def test_bf16_pages_must_fill_packed_sublanes():
    case = _small_case(group=2)
    q, cache, md = _cast(jnp.bfloat16)(case.q, KVCache(case.cache.k[:, :, :8],
                                                       case.cache.v[:, :, :8]), case.md)
    with pytest.raises(ValueError, match="multiple of 16"):
        pallas_tpu_ragged_paged_attention(q, cache, 0, md, sm_scale=0.125)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_8bit_pages_must_fill_packed_sublanes(kv_dtype):
    """The engine's default 16-token pages are half a tile of 8-bit values: a clear error."""
    case = _small_case(group=2)
    with pytest.raises(ValueError, match=r"page_size \(--block-size\) must be a multiple of "
                                         r"32 for (int8|float8_e4m3fn) KV pages.*got 16"):
        pallas_tpu_ragged_paged_attention(case.q, _stored(case.cache, kv_dtype), 0, case.md,
                                          sm_scale=0.125)


@pytest.mark.parametrize("block_q", [0, 2.5])
def test_bad_block_size_raises(block_q):
    case = _small_case(group=2)
    with pytest.raises(ValueError, match="block_q"):
        kernel(case.q, case.cache, 0, case.md, sm_scale=0.125, block_q=block_q)

