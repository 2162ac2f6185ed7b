"""The pure-JAX reference for ragged paged attention: the ground truth the kernels are
tested against, and the backend wherever no kernel serves (`ops.attention.resolve_backend`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ops.attention import AttentionMetadata, check_inputs
from ops.kv_cache import KVCache, read_kv


def history_block(num_tokens: int, page_size: int, block_rows: int = 16,
                  block_kv: int | None = None) -> tuple[int, int]:
    """(rows, keys) of one block of the reference's history loop for a `num_tokens` step: up
    to `block_rows` rows, and whole pages of keys, `block_kv` of them or, when None, 128 keys
    for a lone row and 64 for more (measured, see ref_ragged_paged_attention)."""
    rows = min(block_rows, num_tokens)
    if block_kv is None:
        block_kv = 128 if rows == 1 else 64
    return rows, max(1, block_kv // page_size) * page_size


def ref_ragged_paged_attention(
    q: jax.Array,          # [T, H, D]
    cache: KVCache,
    layer,                 # scalar int: which layer's pages to read
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_kv: int | None = None,
    block_rows: int = 16,
) -> jax.Array:            # [T, H, D]
    """Ragged paged attention in plain JAX, at a cost that follows the step's real lengths.

    Each row's keys are split in two, both folded into one online softmax accumulated in
    float32 from K/V in their stored dtype:

    1. This step's own tokens, read back once by their slots (write_kv put them there) and
       attended densely, per KV head as one [T * group, T] product masked to the row's own
       sequence (causal).
    2. The sequence's history (positions before its first row in this step, in pages written
       by earlier steps), for blocks of `block_rows` rows up to the last row that has any
       (the engine puts sequences with history first), each reading its rows' pages
       `block_kv` keys at a time up to the block's longest history. Neither loop's trip count
       depends on the page table's width or the page pool. Small blocks measured fastest on
       the 2-core CPU (a 64-row decode in 16-row x 64-key blocks against one 64 x 256 block):
       the gathered K/V of a block stay in cache (docs/performance-log.md, "The step costs what
       the work costs"). Blocks of 64 keys were also faster than 128 at 2 to 8 rows, and for
       a lone row the scores are laid out [Hkv, n, G] so that the keys are the left operand
       of both dots, which measured faster at 1,024 keys; at more rows that layout was
       slower (docs/performance-log.md, "A lone decode's output projection, and where a 64-row
       decode step goes"). A lone decode takes 128 keys a block, since each trip of the loop
       has a fixed cost; but a block reads all its keys however few are real: at 80 keys
       128-key blocks ran much faster than 512-key ones, and at 1,024 to 2,000 keys the two
       were close (measured on the 2-core CPU; docs/performance.md).

    The running output is kept normalized (divided by its softmax sum after each block) and
    flat, [T, H * D], so what leaves the loops is the very matrix the output projection
    reads. XLA:CPU computes a one-row matmul as a loop into which it fuses the elementwise
    producers of the row, reshapes included: an output divided after the loop, or reshaped
    from [T, Hkv, G, D], was recomputed with index arithmetic for every weight row, and a
    lone decode's output projection ran much slower than the query projection of the same
    shape, which showed in the time a token at c=1 (docs/performance-log.md, "A lone decode's
    output projection, and where a 64-row decode step goes").
    """
    check_inputs(q, cache, md)
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = cache.page_size, cache.k.shape[3]
    group = num_heads // num_kv_heads
    rows_per_block, block_kv = history_block(num_tokens, page_size, block_rows, block_kv)
    pages_per_block = block_kv // page_size
    lone = rows_per_block == 1
    n_axis = 2 if lone else 3  # the keys' axis of a block's scores
    f32 = jnp.float32

    valid = md.token_seq >= 0                      # [T]
    seq = jnp.maximum(md.token_seq, 0)             # [T]
    pos = md.positions                             # [T]
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    history = jnp.where(valid, (md.kv_lens - q_lens)[seq], 0)  # [T] keys before this step
    lowest = (jnp.zeros_like(pos) if sliding_window is None
              else jnp.maximum(pos - sliding_window + 1, 0))  # [T] first visible key
    qg = (q.reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale).astype(q.dtype)

    def capped(s):
        return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)

    def normalized(acc, total):  # padded rows and rows without keys (total 0): 0
        return acc / jnp.where(total > 0, total, 1.0)[..., None]

    # 1. This step's tokens: [Hkv, T * G, T] scores, row t * G + g.
    page, offset = md.slot_mapping // page_size, md.slot_mapping % page_size
    def gather(pages, scales, *index):
        return read_kv(pages[index], None if scales is None else scales[index], q.dtype)

    k_new = gather(cache.k, cache.k_scale, layer, page, offset).transpose(1, 0, 2)  # [Hkv, T, D]
    v_new = gather(cache.v, cache.v_scale, layer, page, offset).transpose(1, 0, 2)
    q_heads = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_tokens * group, head_dim)
    s = capped(jnp.einsum("kmd,knd->kmn", q_heads, k_new, preferred_element_type=f32))
    s = s.reshape(num_kv_heads, num_tokens, group, num_tokens)
    mask = ((md.token_seq[None, :] == md.token_seq[:, None]) & valid[:, None]
            & (pos[None, :] <= pos[:, None]) & (pos[None, :] >= lowest[:, None]))  # [T, T]
    s = jnp.where(mask[None, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)                                   # [Hkv, T, G]
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    o = jnp.einsum("kmn,knd->kmd", p.reshape(num_kv_heads, num_tokens * group, num_tokens)
                   .astype(v_new.dtype), v_new, preferred_element_type=f32)
    to_rows = lambda x: jnp.moveaxis(x, 0, 1)  # [Hkv, T, ...] -> [T, Hkv, ...]
    m, total = to_rows(m), to_rows(p.sum(-1))  # running max and sum [T, Hkv, G]
    o = to_rows(o.reshape(num_kv_heads, num_tokens, group, head_dim))
    flat = (num_tokens, num_heads * head_dim)
    state = (normalized(o, total).reshape(flat), m, total)

    # 2. History, by blocks of rows and, within them, blocks of keys.
    pad = -num_tokens % rows_per_block
    padded = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    history_p, lowest_p, seq_p, qg_p = (padded(x) for x in (history, lowest, seq, qg))
    state = tuple(padded(x) for x in state)
    max_pages = md.page_tables.shape[1]
    tables = jnp.pad(md.page_tables, ((0, 0), (0, -max_pages % pages_per_block)))
    offsets = jnp.arange(block_kv, dtype=jnp.int32)

    def row_block(r, state):
        first = r * rows_per_block
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, first, rows_per_block)
        hist, low, sq, qb = take(history_p), take(lowest_p), take(seq_p), take(qg_p)

        def key_block(b, carry):
            out, m_prev, l_prev = carry
            cols = jax.lax.dynamic_slice_in_dim(tables, b * pages_per_block, pages_per_block, 1)
            pages = cols[sq]  # [R, pages_per_block]: whole pages, copied as slabs
            shape = (rows_per_block, block_kv, num_kv_heads, head_dim)
            k = cache.k[layer, pages].reshape(shape).astype(q.dtype)  # the block, in cache
            v = cache.v[layer, pages].reshape(shape).astype(q.dtype)
            # Scores [R, Hkv, G, n], or [R, Hkv, n, G] for a lone row: there the keys are
            # the left operand and XLA:CPU reads them as stored instead of transposing them.
            spec = "rkng" if lone else "rkgn"
            s = jnp.einsum(f"rnkd,rkgd->{spec}", k, qb, preferred_element_type=f32)
            if cache.quantized:  # int8 pages: each key's scale goes on its scores, not its D
                def per_key(scales):  # [R, n, Hkv] -> broadcastable against the scores
                    x = scales[layer, pages].reshape(shape[:3]).transpose(0, 2, 1)
                    return x[:, :, :, None] if lone else x[:, :, None, :]
                s = s * per_key(cache.k_scale)
            s = capped(s)
            kv_pos = b * block_kv + offsets
            seen = (kv_pos[None, :] < hist[:, None]) & (kv_pos[None, :] >= low[:, None])
            s = jnp.where(seen[:, None, :, None] if lone else seen[:, None, None, :], s,
                          -jnp.inf)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=n_axis))
            m_safe = jnp.where(jnp.isfinite(m_next), m_next, 0.0)  # no key yet: exp gives 0
            correction = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - jnp.expand_dims(m_safe, n_axis))
            weights = p * per_key(cache.v_scale) if cache.quantized else p  # (and on V's)
            pv = jnp.einsum(f"{spec},rnkd->rkgd", weights.astype(v.dtype), v,
                            preferred_element_type=f32)
            l_next = correction * l_prev + p.sum(n_axis)
            acc = (correction * l_prev)[..., None] * out.reshape(pv.shape) + pv
            return normalized(acc, l_next).reshape(out.shape), m_next, l_next

        with_history = hist > 0
        start = jnp.min(jnp.where(with_history, low, jnp.iinfo(jnp.int32).max)) // block_kv
        carry = jax.lax.fori_loop(start, -(-jnp.max(hist) // block_kv), key_block,
                                  tuple(take(x) for x in state))
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, c, first, 0)
                     for x, c in zip(state, carry, strict=True))

    if num_tokens + pad == rows_per_block:  # one block of rows (decode buckets): no outer loop
        out, _, _ = row_block(0, state)
    else:
        rows = jnp.arange(num_tokens + pad, dtype=jnp.int32)
        last = jnp.max(jnp.where(history_p > 0, rows, -1))  # rows after it have no history
        out, _, _ = jax.lax.fori_loop(0, (last + rows_per_block) // rows_per_block,
                                      row_block, state)
    return out[:num_tokens].reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
