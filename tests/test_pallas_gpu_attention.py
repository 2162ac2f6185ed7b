"""The Pallas GPU ragged paged attention kernel, interpreted on CPU, against the reference and
the float64 oracle; plus a CUDA lowering from CPU that must produce a Triton call."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    INTERPRETED_MATRIX_PARAMS,
    LAYER,
    NUM_LAYERS,
    Case,
    case_from,
    case_of,
    check_kernel,
    make_case,
    reference,
)

from ops.kv_cache import KVCache
from ops.pallas_gpu_attention import _block_sizes, pallas_gpu_ragged_paged_attention

# interpret=None: interpreted on CPU, compiled on a GPU (the bring-up runs these there).
kernel = functools.partial(pallas_gpu_ragged_paged_attention, interpret=None)


def _mixed(group=4, page_size=16, **kw) -> Case:
    return make_case("mixed", num_kv_heads=2, group=group, head_dim=64, page_size=page_size,
                     **kw)


def _long_case(page_size=16, seed=0) -> Case:
    """Long-ish contexts: two decode tokens and a 40-row prefill chunk at ~600 keys."""
    return case_of([(1, 600), (40, 577), (1, 33), (0, 0)], num_kv_heads=2, group=4,
                   head_dim=64, page_size=page_size, seed=seed)


@pytest.mark.parametrize("params", INTERPRETED_MATRIX_PARAMS)
def test_matches_reference(params):
    check_kernel(kernel, case_from(params))


@pytest.mark.parametrize("sliding_window", [1, 5, 16])
def test_sliding_window(sliding_window):
    check_kernel(kernel, _mixed(), sliding_window=sliding_window)


def test_soft_cap():
    check_kernel(kernel, make_case("prefill", num_kv_heads=1, group=4, head_dim=64,
                                   page_size=16), soft_cap=2.0)


def test_soft_cap_and_window():
    check_kernel(kernel, _mixed(group=1), soft_cap=5.0, sliding_window=8)


# The mixed case has 4 page-table columns: 4 or 8 splits of a sequence's few blocks leave
# splits with no block at all; with a window, blocks before it are not walked either.
@pytest.mark.parametrize("splits, block_q, pages_per_block, sliding_window", [
    (1, 4, 1, None), (1, 16, 4, 5), (2, 8, 1, 5), (4, 4, 2, 5), (8, 16, 1, None),
])
def test_explicit_tuning(splits, block_q, pages_per_block, sliding_window):
    tuned = functools.partial(kernel, num_kv_splits=splits, block_q=block_q,
                              pages_per_block=pages_per_block)
    check_kernel(tuned, _mixed(), sliding_window=sliding_window)


def test_long_context_splits_by_default():
    case = _long_case()
    _, _, splits = _block_sizes(case.q, case.cache, case.md, None, None, None)
    assert splits > 1
    check_kernel(kernel, case)


def test_pages_smaller_than_a_dot_tile():
    """8-token pages: a K/V tile needs at least two pages; one is refused."""
    check_kernel(kernel, _mixed(page_size=8))
    case = _mixed(page_size=8)
    with pytest.raises(ValueError, match=r"pages_per_block \* page_size"):
        kernel(case.q, case.cache, 0, case.md, sm_scale=0.125, pages_per_block=1)


def test_traced_layer_under_jit_and_scan():
    """The model calls the kernel with the layer index traced, inside lax.scan over layers;
    also the default `interpret=None`, which interprets on CPU."""
    case = _mixed()
    sm_scale = 0.125
    attend = lambda layer: pallas_gpu_ragged_paged_attention(case.q, case.cache, layer,
                                                             case.md, sm_scale=sm_scale)
    _, per_layer = jax.lax.scan(lambda c, layer: (c, attend(layer)), None,
                                jnp.arange(NUM_LAYERS))
    for layer in range(NUM_LAYERS):
        ref = reference(case.q, case.cache, layer, case.md, sm_scale=sm_scale)
        np.testing.assert_allclose(per_layer[layer], ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(jax.jit(attend)(layer), ref, rtol=1e-5, atol=1e-5)
    assert not np.allclose(per_layer[0], per_layer[1])  # the layer index is really used


@pytest.mark.parametrize("splits", [1, 2])
def test_lowers_to_triton_for_cuda(splits):
    """Runs the Pallas-to-Triton lowering from CPU (no GPU, and no Triton compile)."""
    case = _mixed(dtype=jnp.bfloat16)
    attend = jax.jit(functools.partial(pallas_gpu_ragged_paged_attention, sm_scale=0.125,
                                       interpret=False, num_kv_splits=splits,
                                       sliding_window=8, soft_cap=5.0))
    text = attend.trace(case.q, case.cache, LAYER, case.md).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]
    assert f"grid_z = {splits} " in text


@pytest.mark.parametrize("bad, match", [
    (lambda q, c, md: (q[:, :3], c, md), "not divisible"),
    (lambda q, c, md: (q, KVCache(c.k, c.v.astype(jnp.bfloat16)), md), "share a dtype"),
    (lambda q, c, md: (q, c, dataclasses.replace(md, page_tables=md.page_tables.astype(jnp.int16))),
     "int32"),
    (lambda q, c, md: (q[..., :48], KVCache(c.k[..., :48], c.v[..., :48]), md),
     "power of two"),
    (lambda q, c, md: (q[..., :32], c, md), "head_dim"),
    (lambda q, c, md: (q[0], c, md), r"\[T, H, D\]"),
])
def test_bad_inputs_raise(bad, match):
    case = _mixed(group=2)
    q, cache, md = bad(case.q, case.cache, case.md)
    with pytest.raises(ValueError, match=match):
        pallas_gpu_ragged_paged_attention(q, cache, 0, md, sm_scale=0.125)


@pytest.mark.parametrize("tuning, match", [
    (dict(block_q=3), "block_q must be a power of two"),
    (dict(block_q=4), r"block_q \* group"),  # 4 rows * group 2 < 16
    (dict(pages_per_block=3), "pages_per_block must be a power of two"),
    (dict(num_kv_splits=0), "num_kv_splits"),
])
def test_bad_tuning_raises(tuning, match):
    case = _mixed(group=2)
    with pytest.raises(ValueError, match=match):
        pallas_gpu_ragged_paged_attention(case.q, case.cache, 0, case.md, sm_scale=0.125,
                                          **tuning)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_group_that_is_not_a_power_of_two(kind):
    # SmolLM2-135M: 9 query heads over 3 KV heads; the kernel pads each group to 4 heads.
    check_kernel(kernel, make_case(kind, num_kv_heads=3, group=3, head_dim=64, page_size=16))
