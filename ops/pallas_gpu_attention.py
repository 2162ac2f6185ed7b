"""Ragged paged attention as a Pallas GPU (Triton) kernel; runs on CPU with `interpret=True`.

Same signature and semantics as `ref_ragged_paged_attention` in ops/attention.py.

Design (first version, correctness over speed): one grid step per (query row, KV head).
Each step reads its row's sequence id and position (computed outside the kernel by
`_token_layout`), walks that sequence's pages from the first one inside the sliding
window to the one holding the row's own position, and keeps a flash-attention style
running max / denominator / accumulator for the row's `group` query heads. Every page
visited holds at least one key the row may see, so the running max is finite after the
first page; rows that are padding visit no page and come out as zeros.

Logits are a broadcast multiply-reduce rather than `pl.dot`, because a single row gives
an M dimension of `group` (often 1), below what Triton's dot accepts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from ops.attention import AttentionMetadata, KVCache, _token_layout


def _kernel(
    layer_ref,   # [1] int32
    seq_ref,     # [T] int32: sequence of each query row
    pos_ref,     # [T] int32: position of each query row in its sequence
    valid_ref,   # [T] int32: 1 for real rows, 0 for padding
    kv_lens_ref,  # [S] int32
    tables_ref,  # [S, max_pages] int32
    q_ref,       # [group, D]: this row's query heads for this KV head
    k_ref,       # [L, P, page_size, Hkv, D]
    v_ref,       # [L, P, page_size, Hkv, D]
    o_ref,       # [group, D]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    row, head = pl.program_id(0), pl.program_id(1)
    group, head_dim = q_ref.shape
    page_size = k_ref.shape[2]
    max_pages = tables_ref.shape[1]
    layer = layer_ref[0]
    seq, pos, valid = seq_ref[row], pos_ref[row], valid_ref[row]
    kv_len = kv_lens_ref[seq]

    first_kv = 0 if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)
    first_page = first_kv // page_size
    last_page = jnp.minimum(pl.cdiv(jnp.minimum(pos + 1, kv_len), page_size), max_pages)
    last_page = jnp.where(valid != 0, last_page, first_page)  # padding rows: no pages

    q = q_ref[...].astype(jnp.float32)  # [group, D]

    def body(j, carry):
        acc, m_prev, l_prev = carry  # [group, D], [group], [group]
        page = tables_ref[seq, j]
        k = k_ref[layer, page, :, head, :].astype(jnp.float32)  # [page_size, D]
        v = v_ref[layer, page, :, head, :].astype(jnp.float32)  # [page_size, D]
        s = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1) * sm_scale  # [group, page_size]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = j * page_size + jnp.arange(page_size, dtype=jnp.int32)  # [page_size]
        mask = (kv_pos <= pos) & (kv_pos < kv_len)
        if sliding_window is not None:
            mask &= kv_pos > pos - sliding_window
        s = jnp.where(mask[None, :], s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))  # finite: page has a visible key
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])  # [group, page_size]
        l_next = correction * l_prev + jnp.sum(p, axis=-1)
        acc = correction[:, None] * acc + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return acc, m_next, l_next

    init = (jnp.zeros((group, head_dim), jnp.float32),
            jnp.full((group,), -jnp.inf, jnp.float32),
            jnp.zeros((group,), jnp.float32))
    acc, _, denom = jax.lax.fori_loop(first_page, last_page, body, init)
    o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _validate(q, cache: KVCache, md: AttentionMetadata):
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    if cache.k.ndim != 5 or cache.k.shape != cache.v.shape:
        raise ValueError(f"cache k/v must both be [L, P, page, Hkv, D], got "
                         f"{cache.k.shape} and {cache.v.shape}")
    _, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, kv_head_dim = cache.k.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {kv_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    # Triton block shapes must be powers of two.
    for name, n in (("head_dim", head_dim), ("page_size", page_size),
                    ("num_heads // num_kv_heads", group)):
        if not _is_pow2(n):
            raise ValueError(f"{name} must be a power of two, got {n}")
    if head_dim < 16:
        raise ValueError(f"head_dim must be at least 16, got {head_dim}")
    if q.dtype != cache.k.dtype or cache.k.dtype != cache.v.dtype:
        raise ValueError(f"dtypes must match: q {q.dtype}, k {cache.k.dtype}, v {cache.v.dtype}")
    for name in ("query_start_loc", "kv_lens", "page_tables"):
        if getattr(md, name).dtype != jnp.int32:
            raise ValueError(f"md.{name} must be int32, got {getattr(md, name).dtype}")
    num_seqs = md.kv_lens.shape[0]
    if md.query_start_loc.shape != (num_seqs + 1,) or md.page_tables.ndim != 2 \
            or md.page_tables.shape[0] != num_seqs:
        raise ValueError(f"metadata shapes disagree: query_start_loc {md.query_start_loc.shape}, "
                         f"kv_lens {md.kv_lens.shape}, page_tables {md.page_tables.shape}")


def pallas_gpu_ragged_paged_attention(
    q: jax.Array,          # [T, H, D]
    cache: KVCache,
    layer,                 # scalar int: which layer's pages to read
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:            # [T, H, D]
    """Ragged paged attention; `interpret=None` interprets unless the backend is a GPU."""
    _validate(q, cache, md)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _attention(q, cache, jnp.asarray(layer, jnp.int32), md, sm_scale=float(sm_scale),
                      sliding_window=sliding_window, soft_cap=soft_cap,
                      interpret=bool(interpret))


@functools.partial(jax.jit,
                   static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret"))
def _attention(q, cache, layer, md, *, sm_scale, sliding_window, soft_cap, interpret):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[3]
    group = num_heads // num_kv_heads
    seq, q_pos, valid = _token_layout(md, num_tokens)
    q_grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)

    whole = pl.BlockSpec()  # the full array, indexed inside the kernel
    row_block = pl.BlockSpec((None, None, group, head_dim), lambda t, h: (t, h, 0, 0))
    kernel = functools.partial(_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap)
    out = pl.pallas_call(
        kernel,
        grid=(num_tokens, num_kv_heads),
        in_specs=[whole] * 6 + [row_block, whole, whole],
        out_specs=row_block,
        out_shape=jax.ShapeDtypeStruct(q_grouped.shape, q.dtype),
        interpret=interpret,
        # Picks the Triton lowering; without it jax 0.10 lowers GPU pallas_calls to Mosaic GPU.
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),
        name="ragged_paged_attention_row",
    )(layer.reshape(1), seq, q_pos, valid.astype(jnp.int32), md.kv_lens, md.page_tables,
      q_grouped, cache.k, cache.v)
    return out.reshape(num_tokens, num_heads, head_dim)
