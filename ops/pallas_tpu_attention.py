"""Ragged paged attention as a Pallas TPU (Mosaic) kernel; runs on CPU in TPU interpret mode.

Same signature and semantics as `ref_ragged_paged_attention` in ops/reference_attention.py.

Design. Outside the kernel (plain JAX) the ragged batch is cut into a static number of
*work items*, each up to `block_q` query rows of ONE sequence; there are at most
cdiv(T, block_q) + S of them, the spare ones empty. Their rows are gathered into a padded
[items, Hkv, block_q * group, D] query array, so a KV head's `group` query heads sit in one
[block_q * group, D] tile (GQA by folding the group into the matmul's M dimension), and the
padded output is gathered back to [T, H, D] afterwards: the kernel never writes ragged rows.

The grid is (work item, KV head). Scalar prefetch (SMEM) holds the layer, each item's
sequence, first query position and row count, the KV lengths and the flattened page tables.
K/V stay in HBM; for each block of `pages_per_block` pages the kernel DMAs the pages it
needs for its head into a VMEM buffer with two slots, starting the next block's copies
before computing the current one (double buffering, one DMA semaphore per slot and K/V;
int8 pages bring their scales along in the same copies, see below).
Only pages inside the item's causal / sliding-window range are copied; blocks outside it
are not visited. Across blocks it keeps a flash-attention running max, denominator and
float32 accumulator; rows with no visible key (padding) come out as exact zeros.

KV page dtypes. float32 and bfloat16 pages are converted to q's dtype in VMEM. fp8
(float8_e4m3fn) pages go through float32 first, as JAX's own TPU ragged attention does
with its fp8 pages (its comment: Mosaic does not convert between arbitrary types). int8
pages come with a float32 scale per token and KV head (`KVCache.k_scale` / `v_scale`,
[L, P, page_size, Hkv]): with each page's K (V) copy the kernel copies that page's
[page_size, Hkv] scale slab (every head: only leading dims are indexed) into a third
(fourth) double buffer, picks its head's column ([block_kv, 1], a masked lane sum) and
dequantizes the block: int8 -> float32, times the column, -> q's dtype. The reference
puts each key's scale on its scores and each value's on the softmax weights instead
(M x block_kv multiplies rather than block_kv x D), but that needs the per-key scales
along lanes (the scores' key axis) while the copies bring them along sublanes, one token
a row like the page rows: a transpose or an extra matmul per block. The block is
dequantized instead (a lane broadcast, as JAX's TPU kernels apply their KV scales); the
trade is unmeasured. float16 pages are refused: the Pallas TPU docs list float32,
bfloat16 and integer types, not float16, and TPUs have no float16 arithmetic (bfloat16
pages take the same bytes).

Block sizes (keyword overrides `block_q`, `pages_per_block`): block_q defaults to the mean
query length T / S rounded up to a power of two, clamped so block_q * group lies in
[8, MAX_BLOCK_ROWS]; pages_per_block defaults to TARGET_BLOCK_KV // page_size (at least 1,
at most the page table's width).

Limits:
- SMEM: the page tables (S x max_pages int32) and three int32 per work item are scalar
  prefetch; this must fit the core's SMEM (1 MiB on TPU v4 and later, 16 KiB on v2/v3).
  `_validate` rejects more than 1 MiB.
- Tiling on a real TPU: page_size must be a multiple of 8 (float32), 16 (bfloat16) or 32
  (int8, fp8: four values packed per 32-bit sublane) so pages stack into a [block_kv, D]
  buffer along whole sublane tiles; head_dim must be a multiple of 64 (128 fills the
  lanes; 64 pads them to half use). The engine's default page (--block-size 16) is too
  small for 8-bit pages here.
- int8 scales on a real TPU (expected from TPU tiling, not seen): the [.., page_size, Hkv]
  scale arrays have Hkv on the 128 lanes, so in HBM and in the VMEM scale buffers
  ([2, block_kv, Hkv]: 512 KiB each at the default 512 keys) each token's scales would
  take a padded 128-lane row whatever Hkv is; with few KV heads the scales could outweigh
  the int8 pages. A layout with tokens minor ([.., Hkv, page_size], in ops/attention.py)
  would be dense. fp8 pages: JAX tests its own TPU kernel's fp8 pages on TPU v5 and newer
  only.
- A KV head's page is a strided [page_size, D] slice of the [L, P, page_size, Hkv, D] cache;
  a head-major cache layout would make these DMAs contiguous.
- Double buffering is within a work item: an item's first KV block is not prefetched
  during the previous grid step, so each (item, head) step starts with one exposed DMA.
  A decode row in a batch whose default block_q > 1 occupies a whole block_q-row tile.
- Mosaic kernels are not partitioned automatically: under a mesh, wrap in `shard_map`.
- Tested only in TPU interpret mode on CPU, plus Pallas's Mosaic lowering (jax.export for
  platform "tpu"); never compiled by libtpu, run or timed on TPU hardware (int8 and fp8
  pages included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ops.attention import AttentionMetadata, check_inputs, num_work_items, work_items
from ops.kv_cache import KVCache

SMEM_BYTES = 1 << 20   # per TensorCore on TPU v4 and later
TARGET_BLOCK_KV = 512  # keys per KV block when pages_per_block is not given
MAX_BLOCK_ROWS = 128   # block_q * group when block_q is not given (one MXU pass of rows)


def _kernel(
    # Scalar prefetch (SMEM).
    layer_ref,      # [1]: which layer's pages to read
    item_seq_ref,   # [W]: the sequence of each work item
    item_pos_ref,   # [W]: position in its sequence of the item's first query row
    item_rows_ref,  # [W]: real query rows in the item (0 for spare items)
    kv_lens_ref,    # [S]
    tables_ref,     # [S * max_pages]: page tables, flattened
    # Inputs.
    q_ref,          # [block_q * group, D] (VMEM): row r is query row r // group, head r % group
    k_hbm,          # [L, P, page_size, Hkv, D] (HBM)
    v_hbm,          # [L, P, page_size, Hkv, D] (HBM)
    *refs,          # int8 pages: k_scale_hbm, v_scale_hbm [L, P, page_size, Hkv] f32 (HBM);
                    # then the output o_ref [block_q * group, D] (VMEM); then scratch:
                    # k_buf, v_buf [2, block_kv, D] (VMEM): two slots of pages_per_block pages;
                    # int8 pages: k_scale_buf, v_scale_buf [2, block_kv, Hkv] f32 (VMEM);
                    # sems: DMA semaphores [kinds, 2]: (K, V[, K scale, V scale]) x slot
    group: int,
    pages_per_block: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    quantized: bool,
):
    if quantized:
        k_scale_hbm, v_scale_hbm, o_ref, k_buf, v_buf, k_scale_buf, v_scale_buf, sems = refs
    else:
        (o_ref, k_buf, v_buf, sems), k_scale_buf, v_scale_buf = refs, None, None
    item, head = pl.program_id(0), pl.program_id(1)
    num_rows_q, head_dim = q_ref.shape
    page_size = k_hbm.shape[2]
    block_kv = pages_per_block * page_size
    max_pages = tables_ref.shape[0] // kv_lens_ref.shape[0]
    layer, seq = layer_ref[0], item_seq_ref[item]
    first_pos, num_rows = item_pos_ref[item], item_rows_ref[item]

    # Pages holding keys some row of this item may see: [first_page, last_page].
    last_pos = first_pos + num_rows - 1
    lowest_key = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    # lax.div / lax.rem: these are non-negative where it matters, and jnp's floor
    # semantics would lower to sign fix-ups.
    first_page, last_page = lax.div(lowest_key, page_size), lax.div(last_pos, page_size)
    first_block = lax.div(first_page, pages_per_block)
    end_block = jnp.where(num_rows > 0, lax.div(last_page, pages_per_block) + 1, first_block)

    def for_each_page_copy(block, slot, action):
        """Apply `action` ("start" or "wait") to the copy of each needed page of KV block
        `block` (K and V, and int8 pages' scales) into buffer slot `slot`."""
        def one_page(j, _):
            col = block * pages_per_block + j
            page = tables_ref[seq * max_pages + jnp.minimum(col, max_pages - 1)]
            rows = pl.ds(pl.multiple_of(j * page_size, page_size), page_size)

            @pl.when((col >= first_page) & (col <= last_page))
            def _():
                # The head's [page_size, D] rows of K and V; int8 pages' scales for every
                # head, [page_size, Hkv] (the head is picked in VMEM, see read below).
                sources = [hbm.at[layer, page, :, head, :] for hbm in (k_hbm, v_hbm)]
                buffers = [k_buf, v_buf]
                if quantized:
                    sources += [hbm.at[layer, page] for hbm in (k_scale_hbm, v_scale_hbm)]
                    buffers += [k_scale_buf, v_scale_buf]
                for kind, (src, buf) in enumerate(zip(sources, buffers, strict=True)):
                    copy = pltpu.make_async_copy(src, buf.at[slot, rows], sems.at[kind, slot])
                    getattr(copy, action)()
            return 0

        lax.fori_loop(0, pages_per_block, one_page, 0)

    q = q_ref[...]  # [block_q * group, D]
    shape = (num_rows_q, block_kv)
    q_index = lax.div(lax.broadcasted_iota(jnp.int32, shape, 0), group)
    q_pos = first_pos + q_index                                 # [block_q * group, block_kv]
    row_ok = q_index < num_rows
    key_offset = lax.broadcasted_iota(jnp.int32, shape, 1)      # [block_q * group, block_kv]
    buf_row = lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)  # [block_kv, 1]

    def read(buf, scale_buf, slot):
        """Slot `slot` of a K or V buffer as [block_kv, D] in q's dtype."""
        x = buf[slot]
        if x.dtype.itemsize == 1:  # int8, fp8: through float32, as JAX's own TPU kernel
            x = x.astype(jnp.float32)  # does (Mosaic does not convert arbitrary type pairs)
        if scale_buf is not None:  # int8: times each token's scale for this head
            scales = scale_buf[slot]  # [block_kv, Hkv]
            lane = lax.broadcasted_iota(jnp.int32, scales.shape, 1)
            x = x * jnp.sum(jnp.where(lane == head, scales, 0.0), axis=1, keepdims=True)
        return x.astype(q.dtype)

    def body(block, carry):
        m_prev, l_prev, acc = carry  # [M, 1], [M, 1], [M, D] with M = block_q * group
        slot = lax.rem(block - first_block, 2)

        @pl.when(block + 1 < end_block)
        def _prefetch_next():
            for_each_page_copy(block + 1, 1 - slot, "start")

        for_each_page_copy(block, slot, "wait")
        k, v = read(k_buf, k_scale_buf, slot), read(v_buf, v_scale_buf, slot)  # [block_kv, D]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale  # [M, block_kv]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = block * block_kv + key_offset
        mask = row_ok & (kv_pos <= q_pos)
        if sliding_window is not None:
            mask &= kv_pos > q_pos - sliding_window
        s = jnp.where(mask, s, -jnp.inf)  # also drops logits of slots that were not copied
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows with nothing visible yet
        correction = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)
        l_next = correction * l_prev + jnp.sum(p, axis=1, keepdims=True)
        # Slots of pages that were not copied hold stale or uninitialised data (NaN in
        # interpret mode, in pages or scales); p is 0 there, but 0 * NaN is not, so zero
        # those V rows.
        buf_pos = block * block_kv + buf_row
        copied = (buf_pos >= first_page * page_size) & (buf_pos < (last_page + 1) * page_size)
        v = jnp.where(copied, v, jnp.zeros_like(v))
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [M, D]
        return m_next, l_next, correction * acc + pv

    @pl.when(first_block < end_block)
    def _prefetch_first():
        for_each_page_copy(first_block, 0, "start")

    init = (jnp.full((num_rows_q, 1), -jnp.inf, jnp.float32),
            jnp.zeros((num_rows_q, 1), jnp.float32),
            jnp.zeros((num_rows_q, head_dim), jnp.float32))
    _, denom, acc = lax.fori_loop(first_block, end_block, body, init)
    o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)


# KV page dtypes the kernel reads (not float16: see the module docstring).
PAGE_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.int8,
                                            jnp.float8_e4m3fn))


def _validate(q, cache: KVCache, md: AttentionMetadata, block_q, pages_per_block):
    check_inputs(q, cache, md)
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q dtype must be float32 or bfloat16, got {q.dtype}")
    dtype = cache.k.dtype
    if dtype not in PAGE_DTYPES:
        raise ValueError(f"{dtype} KV pages are not supported by the TPU kernel: it reads "
                         "float32, bfloat16, int8 and fp8 (float8_e4m3fn) pages (TPUs have "
                         "no float16 arithmetic and Pallas TPU does not list float16); use "
                         "--kv-cache-dtype bfloat16 (float16's bytes), int8 or fp8")
    # TPU tiling: pages stack along sublanes (8 rows of 32 bits, 16 of 16 bits, 32 of 8
    # bits packed four to a sublane); D fills lanes.
    sublanes = 8 * (4 // dtype.itemsize)
    if cache.page_size % sublanes:
        raise ValueError(f"page_size (--block-size) must be a multiple of {sublanes} for "
                         f"{dtype} KV pages on the TPU kernel (a page must fill whole "
                         f"{sublanes}-row tiles), got {cache.page_size}")
    if q.shape[2] % 64:
        raise ValueError(f"head_dim must be a multiple of 64, got {q.shape[2]}")
    for name, n in (("block_q", block_q), ("pages_per_block", pages_per_block)):
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"{name} must be a positive int, got {n!r}")


def _default_block_q(num_tokens: int, num_seqs: int, group: int) -> int:
    """Rows per work item: the mean query length rounded up to a power of two, kept so
    that block_q * group spans at least a sublane tile and at most MAX_BLOCK_ROWS."""
    mean = -(-num_tokens // num_seqs)
    lo, hi = max(1, 8 // group), max(1, MAX_BLOCK_ROWS // group)
    return min(max(1 << (mean - 1).bit_length(), lo), hi)


def pallas_tpu_ragged_paged_attention(
    q: jax.Array,          # [T, H, D]
    cache: KVCache,
    layer,                 # scalar int, may be traced: which layer's pages to read
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
) -> jax.Array:            # [T, H, D]
    """Ragged paged attention; `interpret=None` interprets unless the backend is a TPU, and
    `InterpretParams` (e.g. with `detect_races=True`) pick how. `block_q` (query rows per
    work item) and `pages_per_block` (pages per KV block) default per shape."""
    _validate(q, cache, md, block_q, pages_per_block)
    num_tokens, num_heads, _ = q.shape
    num_kv_heads, page_size = cache.k.shape[3], cache.page_size
    num_seqs, max_pages = md.page_tables.shape
    group = num_heads // num_kv_heads
    if block_q is None:
        block_q = _default_block_q(num_tokens, num_seqs, group)
    if pages_per_block is None:
        pages_per_block = max(1, min(max_pages, TARGET_BLOCK_KV // page_size))
    num_items = num_work_items(num_tokens, num_seqs, block_q)
    smem = 4 * (1 + 3 * num_items + num_seqs + num_seqs * max_pages)
    if smem > SMEM_BYTES:
        raise ValueError(f"scalar prefetch needs {smem} bytes of SMEM (page tables "
                         f"{num_seqs} x {max_pages}), more than {SMEM_BYTES}")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    if not isinstance(interpret, pltpu.InterpretParams):
        interpret = pltpu.InterpretParams() if interpret else False
    out = _attention(q, cache, jnp.asarray(layer, jnp.int32), md, sm_scale=float(sm_scale),
                     sliding_window=sliding_window, soft_cap=soft_cap, block_q=block_q,
                     pages_per_block=pages_per_block, interpret=interpret)
    if interpret and not isinstance(out, jax.core.Tracer):
        # The TPU interpreter runs eager jax ops inside its host callbacks. An eager op of the
        # caller's, queued behind the still-running kernel, deadlocked with them once
        # (jax 0.10.2, CI): called eagerly, finish before returning.
        out.block_until_ready()
    return out


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "block_q", "pages_per_block", "interpret"))
def _attention(q, cache, layer, md, *, sm_scale, sliding_window, soft_cap, block_q,
               pages_per_block, interpret):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = cache.k.shape[3], cache.page_size
    group = num_heads // num_kv_heads
    num_items = num_work_items(num_tokens, md.kv_lens.shape[0], block_q)
    block_rows = block_q * group
    (seq, first_row, first_pos, num_rows), (row_item, row_in_item, valid) = work_items(
        md, num_tokens, block_q)

    # [W, Hkv, block_q * group, D]: each item's rows, a KV head's query heads side by side.
    rows = jnp.minimum(first_row[:, None] + jnp.arange(block_q), num_tokens - 1)  # [W, bq]
    q_items = q[rows].reshape(num_items, block_q, num_kv_heads, group, head_dim)
    q_items = q_items.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, block_rows,
                                                       head_dim)

    tile = pl.BlockSpec((None, None, block_rows, head_dim), lambda w, h, *_: (w, h, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    quantized = cache.quantized
    kernel = functools.partial(_kernel, group=group, pages_per_block=pages_per_block,
                               sm_scale=sm_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, quantized=quantized)
    block_kv = pages_per_block * page_size
    pages = [pltpu.VMEM((2, block_kv, head_dim), cache.k.dtype)] * 2
    scales = [pltpu.VMEM((2, block_kv, num_kv_heads), jnp.float32)] * 2 if quantized else []
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_items, num_kv_heads),
            in_specs=[tile] + [hbm] * (4 if quantized else 2),
            out_specs=tile,
            scratch_shapes=[*pages, *scales,
                            pltpu.SemaphoreType.DMA((4 if quantized else 2, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct(q_items.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(layer.reshape(1), seq, first_pos, num_rows, md.kv_lens, md.page_tables.reshape(-1),
      q_items, cache.k, cache.v, *((cache.k_scale, cache.v_scale) if quantized else ()))

    # Back to [T, H, D]: token t is row (t - first row of its item) of its item.
    out = out.reshape(num_items, num_kv_heads, block_q, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_items * block_q, num_heads, head_dim)
    flat = row_item * block_q + row_in_item
    return jnp.where(valid[:, None, None], out[flat], jnp.zeros((), q.dtype))
