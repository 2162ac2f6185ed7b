"""Ragged paged attention on CPU through xlaserve's own kernel (ops/native/attention.cc).

The CPU's `auto` backend where the kernel could be built (ops/native). It reads one layer
of the KV pool in place (float32, float16, bfloat16 or int8 pages), each sequence's keys
once and only up to each row's own position, and computes in float32 with an online
softmax; the pure-JAX reference (ops/reference_attention.py) is its ground truth in the
tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ops import native
from ops.attention import AttentionMetadata, check_inputs
from ops.kv_cache import KVCache

PAGE_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.float16, jnp.bfloat16, jnp.int8))
MAX_HEAD_DIM = 256  # attention.cc's kMaxHeadDim
MAX_GROUP = 48      # query heads per KV head (attention.cc's kMaxQueries)
SPLIT_KEYS = 64     # a lone decode of this many keys or more is cut by keys over the threads


def cpu_ragged_paged_attention(
    q: jax.Array,          # [T, H, D]
    cache: KVCache,
    layer,                 # scalar int: which layer's pages to read
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    split: bool = True,
) -> jax.Array:            # [T, H, D] in q's dtype
    """The reference's contract (ops/reference_attention.py), in the kernel. `split`: a lone
    long decode may be cut by keys over XLA's threads (faster, but its last bits then depend
    on how many sequences share the step)."""
    check_inputs(q, cache, md)
    num_heads, head_dim = q.shape[1:]
    if cache.k.dtype not in PAGE_DTYPES:
        raise ValueError(f"the CPU attention kernel reads pages of "
                         f"{', '.join(t.name for t in PAGE_DTYPES)}, not {cache.k.dtype}")
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the CPU attention kernel needs head_dim a multiple of 16 up to "
                         f"{MAX_HEAD_DIM}, got {head_dim}")
    if num_heads // cache.k.shape[3] > MAX_GROUP:
        raise ValueError(f"the CPU attention kernel takes at most {MAX_GROUP} query heads "
                         f"per KV head, got {num_heads // cache.k.shape[3]}")
    if not native.available("attention"):
        raise ValueError(f"the CPU attention kernel is not available: {native.reason('attention')}")
    none = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(native.ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), cache.k, cache.v,
               none if cache.k_scale is None else cache.k_scale,
               none if cache.v_scale is None else cache.v_scale,
               md.query_start_loc, md.kv_lens, md.page_tables, jnp.asarray(layer, jnp.int32),
               sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
               window=np.int64(sliding_window or 0),
               split_keys=np.int64(SPLIT_KEYS if split else 0))
    return out.astype(q.dtype)
