"""Ragged paged attention as a Pallas GPU (Triton) kernel; runs on CPU with `interpret=True`.

Same signature and semantics as `ref_ragged_paged_attention` in ops/reference_attention.py.

Design (flash-decoding over blocks of pages):

1. Work items, in plain JAX outside the kernel: each sequence's query rows are cut into
   blocks of `block_q` rows, one work item per block (sequence, first row, row count,
   position of the first row). The item list has the static length cdiv(T, block_q) + S;
   items past the real ones have no rows.
2. Grid (item, KV head, KV split). A program loads its item's `block_q * group` query
   rows for one KV head as one [M, D] tile, so both products are Triton dots (Triton needs
   every dot dimension >= 16, hence M >= 16). It walks its split's share of the
   sequence's pages `pages_per_block` at a time (one K and one V tile of
   pages_per_block * page_size keys per step, loaded through the page table) with a
   flash-attention online softmax, skipping blocks outside the causal / sliding-window
   range of the item's rows.
3. KV splits: the blocks of keys an item may see are cut into `num_kv_splits` contiguous
   runs of whole blocks, as even as they go (by the sequence's length, not the page
   table's width). Each split writes its normalized partial output and log-sum-exp into a
   padded [item, ...] buffer
   (no ragged writes); outside the kernel the rows are gathered back to [T, H, D] and the
   splits merged by a log-sum-exp weighted sum. A split that sees no key has lse = -inf
   and weight 0; padded rows come out exactly 0.

Defaults (`_block_sizes`; each can be passed explicitly): block_q makes M = block_q * group
max(16, group) for decode-heavy buckets (about one row per sequence) and up to
max(64, group) when sequences bring more rows; pages_per_block makes K/V tiles of 64 keys
(at least 16, at most one split's share of the page table); num_kv_splits is 1 unless the
page table spans at least 512 keys and the grid without splits has fewer than 256
programs, then enough splits to reach about 256 programs, at most one per 256 keys and at
most 16.

Limits: it has run on one GPU once (an H100, jax 0.11.2: its tests passed compiled there,
and docs/performance.md has its speed: equal to JAX's bundled kernel at large batch x
context, 1.8-2.7x slower at small batches). CI checks it in interpret mode on CPU and lowers
it for CUDA from CPU (the Pallas-to-Triton lowering, not Triton's own compiler). The
defaults above, num_warps and num_stages are not yet tuned. Decode items use only `group` of
their M >= 16 query rows; head_dim and page_size must be powers of two, and a group
(query heads per KV head) that is not one is padded with zero heads up to the next.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from ops.attention import AttentionMetadata, check_inputs, num_work_items, work_items
from ops.kv_cache import KVCache

# Tuning guesses (never measured on a GPU).
_MIN_DOT_DIM = 16          # Triton's smallest dot dimension
_TARGET_ROWS = 64          # query rows per tile (M) for prefill-heavy steps
_TARGET_KEYS = 64          # keys per K/V tile
_MIN_KEYS_PER_SPLIT = 256  # don't split the KV of short page tables
_TARGET_PROGRAMS = 256     # about two waves of programs on an H100's 132 SMs
_MAX_SPLITS = 16


def _kernel(
    layer_ref,    # [1] int32
    seq_ref,      # [N] int32: sequence of each work item
    row0_ref,     # [N] int32: first query row of each item
    pos0_ref,     # [N] int32: KV position of that row
    nrows_ref,    # [N] int32: query rows in the item (0 for padding items)
    tables_ref,   # [S, whole blocks of pages] int32, padded with page 0
    q_ref,        # [T, H, D]
    k_ref,        # [L, P, page_size, Hkv, D]
    v_ref,        # [L, P, page_size, Hkv, D]
    *refs,        # int8 pages: k_scale_ref, v_scale_ref [L, P, page_size, Hkv] f32; then
                  # o_ref [M, D]: this split's normalized output for the item's rows, and
                  # lse_ref [M] f32: this split's log-sum-exp (-inf: no visible key)
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    pages_per_block: int,
    num_splits: int,
):
    scale_refs, (o_ref, lse_ref) = refs[:-2], refs[-2:]
    item, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows, head_dim = o_ref.shape  # num_rows = block_q * group
    num_tokens = q_ref.shape[0]
    page_size = k_ref.shape[2]
    block_k = pages_per_block * page_size
    layer, seq = layer_ref[0], seq_ref[item]
    row0, pos0, nrows = row0_ref[item], pos0_ref[item], nrows_ref[item]

    # Tile row r is query row row0 + r // group, query head head * group + r % group.
    r = jnp.arange(num_rows, dtype=jnp.int32)
    row_in_item = r // group
    row_ok = row_in_item < nrows
    row_pos = pos0 + row_in_item  # [M]
    rows = jnp.minimum(row0 + row_in_item, num_tokens - 1)
    q = q_ref[rows, head * group + r % group, :]  # [M, D]

    # The blocks of pages holding keys some row of the item may see (from a multiple of
    # pages_per_block; keys before the window's start are masked), shared among the splits
    # as evenly as whole blocks allow: by the keys there are, not by the page table's width,
    # so a short context's keys are spread over every split rather than walked by the
    # first (on an H200 a lone 8B decode's attention took 9.5 us a layer at ~200 keys, one
    # split of 8 walking them all). A split past them sees no key.
    first_kv = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    end_page = jnp.where(nrows > 0, (pos0 + nrows - 1) // page_size + 1, 0)
    first = first_kv // page_size // pages_per_block * pages_per_block
    total = jnp.maximum(pl.cdiv(end_page - first, pages_per_block), 0)
    per_split = pl.cdiv(total, num_splits)
    start = first + split * per_split * pages_per_block
    num_blocks = jnp.clip(total - split * per_split, 0, per_split)

    def body(b, carry):
        acc, m_prev, l_prev = carry  # [M, D], [M], [M]
        first_page = start + b * pages_per_block
        pages = tables_ref[seq, pl.ds(first_page, pages_per_block)]  # [pages_per_block]
        def read(ref, scale_ref):  # [block_k, D] in q's dtype (int8 pages times their scales)
            x = ref[layer, pages, :, head, :].reshape(block_k, head_dim)
            if scale_ref is None:
                return x.astype(q.dtype)
            scale = scale_ref[layer, pages, :, head].reshape(block_k, 1)
            return (x.astype(jnp.float32) * scale).astype(q.dtype)

        k = read(k_ref, scale_refs[0] if scale_refs else None)
        v = read(v_ref, scale_refs[1] if scale_refs else None)
        # HIGHEST: float32 inputs get an IEEE dot instead of TF32; no effect on bf16.
        s = pl_triton.dot(q, k, trans_b=True, precision=jax.lax.Precision.HIGHEST) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = first_page * page_size + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        # kv_pos <= row_pos also keeps keys below kv_len: a real row's position is < kv_len.
        mask = row_ok[:, None] & (kv_pos[None, :] <= row_pos[:, None])
        if sliding_window is not None:
            mask &= kv_pos[None, :] > row_pos[:, None] - sliding_window
        s = jnp.where(mask, s, -jnp.inf)  # [M, block_k]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))
        # A row with no visible key so far keeps m = -inf; shift by 0 so exp gives 0, not NaN.
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        correction = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l_next = correction * l_prev + jnp.sum(p, axis=-1)
        pv = pl_triton.dot(p.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST)
        return correction[:, None] * acc + pv, m_next, l_next

    init = (jnp.zeros((num_rows, head_dim), jnp.float32),
            jnp.full((num_rows,), -jnp.inf, jnp.float32),
            jnp.zeros((num_rows,), jnp.float32))
    acc, m, denom = jax.lax.fori_loop(0, num_blocks, body, init)
    seen = denom > 0
    o_ref[...] = (acc / jnp.where(seen, denom, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _validate(q, cache: KVCache, md: AttentionMetadata):
    check_inputs(q, cache, md)
    head_dim, page_size = q.shape[2], cache.page_size
    # Triton block shapes must be powers of two (a group that is not gets padded heads).
    for name, n in (("head_dim", head_dim), ("page_size", page_size)):
        if not _is_pow2(n):
            raise ValueError(f"{name} must be a power of two, got {n}")
    if head_dim < _MIN_DOT_DIM:
        raise ValueError(f"head_dim must be at least {_MIN_DOT_DIM}, got {head_dim}")


def _default_block_q(num_tokens: int, num_seqs: int, group: int) -> int:
    """Query rows per item: decode-heavy buckets (about one row per sequence) get the
    smallest tile."""
    rows_per_seq = _pow2_ceil(_cdiv(num_tokens, num_seqs))
    return min(max(rows_per_seq, _MIN_DOT_DIM // group, 1), max(_TARGET_ROWS // group, 1))


def block_q_for(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int) -> int:
    """The block_q the kernel picks for this step's shape, query groups padded as
    `pallas_gpu_ragged_paged_attention` pads them (ops.attention.prepare)."""
    return _default_block_q(num_tokens, num_seqs, _pow2_ceil(num_heads // num_kv_heads))


def _block_sizes(q, cache: KVCache, md: AttentionMetadata, block_q, pages_per_block,
                 num_kv_splits) -> tuple[int, int, int]:
    """Fill in the tuning knobs left as None (guesses, see the module docstring) and check
    the ones given."""
    num_tokens, num_heads, _ = q.shape
    page_size, num_kv_heads = cache.k.shape[2], cache.k.shape[3]
    num_seqs, max_pages = md.page_tables.shape
    group = num_heads // num_kv_heads
    if block_q is None:
        block_q = _default_block_q(num_tokens, num_seqs, group)
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be at least 1, got {num_kv_splits}")
    if num_kv_splits is None:
        num_items = num_work_items(num_tokens, num_seqs, block_q)
        by_length = max_pages * page_size // _MIN_KEYS_PER_SPLIT
        by_occupancy = _cdiv(_TARGET_PROGRAMS, num_items * num_kv_heads)
        num_kv_splits = max(1, min(by_length, by_occupancy, _MAX_SPLITS))
    if pages_per_block is None:
        pages_per_split = _pow2_ceil(_cdiv(max_pages, num_kv_splits))
        pages_per_block = max(min(_TARGET_KEYS // page_size, pages_per_split),
                              _MIN_DOT_DIM // page_size, 1)
    for name, n in (("block_q", block_q), ("pages_per_block", pages_per_block)):
        if not _is_pow2(n):
            raise ValueError(f"{name} must be a power of two, got {n}")
    if block_q * group < _MIN_DOT_DIM:
        raise ValueError(f"block_q * group must be at least {_MIN_DOT_DIM}, got "
                         f"{block_q} * {group}")
    if pages_per_block * page_size < _MIN_DOT_DIM:
        raise ValueError(f"pages_per_block * page_size must be at least {_MIN_DOT_DIM}, got "
                         f"{pages_per_block} * {page_size}")
    return block_q, pages_per_block, num_kv_splits


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
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_kv_splits: int | None = None,
) -> jax.Array:            # [T, H, D]
    """Ragged paged attention; `interpret=None` interprets unless the backend is a GPU.
    Tuning knobs left as None are chosen from the shapes."""
    _validate(q, cache, md)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[3]
    group = num_heads // num_kv_heads
    if not _is_pow2(group):  # e.g. 9 heads over 3 KV heads: pad each group with zero heads
        padded = _pow2_ceil(group)
        q_padded = jnp.pad(q.reshape(num_tokens, num_kv_heads, group, head_dim),
                           ((0, 0), (0, 0), (0, padded - group), (0, 0)))
        out = pallas_gpu_ragged_paged_attention(
            q_padded.reshape(num_tokens, num_kv_heads * padded, head_dim), cache, layer, md,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            interpret=interpret, block_q=block_q, pages_per_block=pages_per_block,
            num_kv_splits=num_kv_splits)
        out = out.reshape(num_tokens, num_kv_heads, padded, head_dim)[:, :, :group]
        return out.reshape(num_tokens, num_heads, head_dim)
    block_q, pages_per_block, num_kv_splits = _block_sizes(
        q, cache, md, block_q, pages_per_block, num_kv_splits)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _attention(q, cache, jnp.asarray(layer, jnp.int32), md, sm_scale=float(sm_scale),
                      sliding_window=sliding_window, soft_cap=soft_cap,
                      interpret=bool(interpret), block_q=block_q,
                      pages_per_block=pages_per_block, num_kv_splits=num_kv_splits)


def _merge_splits(o, lse):
    """Log-sum-exp merge of per-split outputs: o [..., K, D], lse [..., K] -> [..., D]."""
    m = jnp.max(lse, axis=-1, keepdims=True)
    w = jnp.exp(lse - jnp.where(m == -jnp.inf, 0.0, m))  # empty splits: weight 0
    denom = jnp.sum(w, axis=-1, keepdims=True)
    return jnp.sum(w[..., None] * o, axis=-2) / jnp.where(denom > 0, denom, 1.0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "interpret", "block_q", "pages_per_block",
                                             "num_kv_splits"))
def _attention(q, cache, layer, md, *, sm_scale, sliding_window, soft_cap, interpret,
               block_q, pages_per_block, num_kv_splits):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[3]
    group = num_heads // num_kv_heads
    num_seqs, max_pages = md.page_tables.shape
    num_items = num_work_items(num_tokens, num_seqs, block_q)
    num_rows = block_q * group

    # Pad the page table to whole blocks, so that every block reads inside it (page 0, masked).
    tables = jnp.pad(md.page_tables, ((0, 0), (0, -max_pages % pages_per_block)))
    items, (item, local, valid) = work_items(md, num_tokens, block_q)

    part_dtype = q.dtype if num_kv_splits == 1 else jnp.float32
    whole = pl.BlockSpec()  # the full array, indexed inside the kernel
    kernel = functools.partial(_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, group=group, pages_per_block=pages_per_block,
                               num_splits=num_kv_splits)
    o, lse = pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads, num_kv_splits),
        in_specs=[whole] * (11 if cache.quantized else 9),
        out_specs=[
            pl.BlockSpec((None, None, None, num_rows, head_dim),
                         lambda i, h, k: (i, h, k, 0, 0)),
            pl.BlockSpec((None, None, None, num_rows), lambda i, h, k: (i, h, k, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_items, num_kv_heads, num_kv_splits, num_rows, head_dim),
                                 part_dtype),
            jax.ShapeDtypeStruct((num_items, num_kv_heads, num_kv_splits, num_rows),
                                 jnp.float32),
        ],
        interpret=interpret,
        # Picks the Triton lowering; without it jax 0.10 lowers GPU pallas_calls to Mosaic GPU.
        # num_warps / num_stages are unmeasured guesses.
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        name="ragged_paged_attention",
    )(layer.reshape(1), *items, tables, q, cache.k, cache.v,
      *((cache.k_scale, cache.v_scale) if cache.quantized else ()))

    # Gather each query row's tile rows back: [T, Hkv, K, group, ...].
    o = o.reshape(num_items, num_kv_heads, num_kv_splits, block_q, group, head_dim)
    o = o[item, :, :, local]  # [T, Hkv, K, group, D]
    if num_kv_splits == 1:
        out = o[:, :, 0]
    else:
        lse = lse.reshape(num_items, num_kv_heads, num_kv_splits, block_q, group)[item, :, :, local]
        out = _merge_splits(jnp.moveaxis(o, 2, -2), jnp.moveaxis(lse, 2, -1))
    out = jnp.where(valid[:, None, None, None], out, 0).astype(q.dtype)
    return out.reshape(num_tokens, num_heads, head_dim)
