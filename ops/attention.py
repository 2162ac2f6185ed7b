"""Ragged paged attention: the KV page layout, the step's attention metadata, and the
pure-JAX reference implementation (the ground truth the Pallas kernels are tested against).

One step is a ragged batch: T query tokens from S sequences laid end to end (prefill
chunks and single decode tokens mixed). Sequence s owns query rows
`query_start_loc[s]:query_start_loc[s+1]`; its KV (history plus this step's tokens) is
`kv_lens[s]` long and lives in the pages listed by `page_tables[s]`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# The mesh axis that tensor parallelism splits heads over (see models/sharding.py).
TENSOR_AXIS = "tensor"

# ---- KV cache layout ---------------------------------------------------------------
#
# k, v: [L, P, page_size, Hkv, D] -- layers stacked so the scanned model step indexes
# layer l; page 0 is a reserved dummy page that padded tokens write into. The pages hold
# K/V in their own dtype (--kv-cache-dtype); every backend reads that and computes in q's.

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
# int8 pages carry a float32 scale per token and KV head (max |x| / 127 over head_dim): the
# scale is set once when the token is written, so no page is ever requantized.
QUANTIZED_KV = (jnp.dtype(jnp.int8),)
# fp8 pages hold e4m3 values as they are (no scale; K/V beyond its +-448 saturate).
FP8 = jnp.dtype(jnp.float8_e4m3fn)
_STORED = {"fp8": FP8}  # --kv-cache-dtype names that are not the dtype's own name


def kv_storage_dtype(name: str):
    """The dtype `--kv-cache-dtype name` stores (any dtype or name jnp.dtype takes, or fp8)."""
    return jnp.dtype(_STORED.get(name, name)) if isinstance(name, str) else jnp.dtype(name)


def resolve_kv_dtype(name: str, compute_dtype, platform: str | None = None):
    """The dtype of an engine's KV pages for `--kv-cache-dtype name` on `platform` (default:
    the default backend's). `auto`: float16 on CPU (half the bytes of float32 to hold and to
    read; llama.cpp's default too), the compute dtype elsewhere. bfloat16 pages are refused
    on CPU: XLA:CPU has no native bfloat16 scatter or gather and converts the whole pool to
    float32 and back for each layer's write (a 1,025-page pool: 3.5 s a step instead of
    0.1 ms; reads 10x slower), while float16 runs natively (attention 20% faster than
    float32, docs/performance.md). int8 pages (53% of float16's bytes at head_dim 64) passed
    parity (top-1 agreement 0.989) and beat float32 at 64 streams on the 2-core CPU, but
    ran ~1% slower than float16 and lose a little accuracy; the default pool is sized
    by a budget either way, so `auto` stays float16 and int8 is the smallest-footprint
    choice."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose from "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    platform = platform or jax.default_backend()
    if name == "auto":
        return jnp.dtype(jnp.float16) if platform == "cpu" else jnp.dtype(compute_dtype)
    if name in ("bfloat16", "fp8") and platform == "cpu":
        raise ValueError(f"--kv-cache-dtype {name} is not supported on CPU (XLA:CPU converts "
                         "the whole KV pool for every write: seconds a step); use float16, "
                         "the default there, or int8")
    return kv_storage_dtype(name)


def kv_token_bytes(dtype, head_dim: int) -> int:
    """Bytes one token's K (or V) takes per KV head in pages of `dtype` (int8: its scale too)."""
    dtype = jnp.dtype(dtype)
    return head_dim * dtype.itemsize + (4 if dtype in QUANTIZED_KV else 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, P, page_size, Hkv, D]
    v: jax.Array  # [L, P, page_size, Hkv, D]
    k_scale: jax.Array | None = None  # [L, P, page_size, Hkv] f32: int8 pages only
    v_scale: jax.Array | None = None

    @classmethod
    def zeros(cls, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype,
              sharding=None):
        """Zeroed pages (and scales, for int8), made directly in `sharding` (e.g. split by KV
        head) when given."""
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        if jnp.dtype(dtype) not in QUANTIZED_KV:
            return cls(make(), make())
        scale_sharding = None if sharding is None else jax.sharding.NamedSharding(
            sharding.mesh, P(*sharding.spec[:4]))
        scales = jax.jit(lambda: jnp.zeros(shape[:4], jnp.float32), out_shardings=scale_sharding)
        return cls(make(), make(), scales(), scales())

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Device arrays describing one ragged step. Padded rows/sequences are harmless:
    padded tokens write to page 0 and padded sequences have no query rows.

    `positions` and `token_seq` repeat, per query row, what `query_start_loc` and `kv_lens`
    say per sequence: the host knows them, so no layer recomputes them (`row_layout` builds
    them where there is no host batch)."""

    slot_mapping: jax.Array     # [T] int32: page * page_size + offset for each token's new K/V
    query_start_loc: jax.Array  # [S + 1] int32: non-decreasing; padded sequences are empty
    kv_lens: jax.Array          # [S] int32: KV length of each sequence including this step
    page_tables: jax.Array      # [S, max_pages] int32: page ids; unused entries point at page 0
    positions: jax.Array        # [T] int32: each query row's position in its sequence
    token_seq: jax.Array        # [T] int32: each query row's sequence; -1 for padded rows


def row_layout(query_start_loc, kv_lens, num_tokens: int):
    """`(positions, token_seq)` of `AttentionMetadata` from the per-sequence arrays (tests,
    single-sequence decoding); the engine fills them on the host instead."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start_loc, rows, side="right").astype(jnp.int32) - 1
    num_seqs = kv_lens.shape[0]
    valid = (seq >= 0) & (seq < num_seqs) & (rows < query_start_loc[-1])
    seq = jnp.clip(seq, 0, num_seqs - 1)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    # Query rows are the last q_len positions of the sequence's KV.
    pos = kv_lens[seq] - q_len + (rows - query_start_loc[seq])
    return jnp.where(valid, pos, 0).astype(jnp.int32), jnp.where(valid, seq, -1).astype(jnp.int32)


def _per_shard(fn, mesh, in_specs, out_specs):
    """`fn` on each device's heads under `shard_map` when `mesh` splits them; else `fn`."""
    if mesh is None or mesh.shape.get(TENSOR_AXIS, 1) == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


_HEADS = P(None, TENSOR_AXIS, None)                 # q, k, v, outputs: [T, heads, D]
_KV_PAGES = P(None, None, None, TENSOR_AXIS, None)  # [L, P, page, Hkv, D]
_KV_SCALES = P(None, None, None, TENSOR_AXIS)       # [L, P, page, Hkv]


def kv_specs(quantized: bool) -> KVCache:
    """How a KV pool splits over the tensor axis: its tree of PartitionSpecs (by KV head)."""
    return (KVCache(_KV_PAGES, _KV_PAGES, _KV_SCALES, _KV_SCALES) if quantized
            else KVCache(_KV_PAGES, _KV_PAGES))


def write_kv(cache: KVCache, layer, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, mesh=None) -> KVCache:
    """Scatter this step's K/V ([T, Hkv, D]) into layer `layer`'s pages (per shard under a
    tensor-parallel mesh: each device writes its own KV heads)."""
    specs = kv_specs(cache.quantized)
    return _per_shard(_write_kv, mesh, (specs, P(), _HEADS, _HEADS, P()), specs)(
        cache, layer, k, v, slot_mapping)


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., D] -> int8 [..., D] and its f32 scale [...] (max |x| / 127; 0 for a zero row)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale


def read_kv(pages: jax.Array, scales: jax.Array | None, dtype) -> jax.Array:
    """Gathered pages ([..., D]) in `dtype`: int8 ones times their scales ([...])."""
    if scales is None:
        return pages.astype(dtype)
    return (pages.astype(jnp.float32) * scales[..., None]).astype(dtype)


def _stored(x: jax.Array, dtype) -> jax.Array:
    if dtype == FP8:  # e4m3 has no infinity: out-of-range values would become NaN
        x = jnp.clip(x.astype(jnp.float32), -448.0, 448.0)
    return x.astype(dtype)


def _write_kv(cache: KVCache, layer, k, v, slot_mapping) -> KVCache:
    page_size = cache.page_size
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    if not cache.quantized:
        return KVCache(
            cache.k.at[layer, pages, offsets].set(_stored(k, cache.k.dtype)),
            cache.v.at[layer, pages, offsets].set(_stored(v, cache.v.dtype)),
        )
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    return KVCache(
        cache.k.at[layer, pages, offsets].set(kq), cache.v.at[layer, pages, offsets].set(vq),
        cache.k_scale.at[layer, pages, offsets].set(ks),
        cache.v_scale.at[layer, pages, offsets].set(vs))


def check_inputs(q, cache: KVCache, md: AttentionMetadata) -> None:
    """The shape, dtype and metadata checks every kernel makes (ValueError, never garbage);
    each kernel adds its own tiling limits."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    if cache.k.ndim != 5 or cache.k.shape != cache.v.shape:
        raise ValueError(f"cache k/v must both be [L, P, page, Hkv, D], got "
                         f"{cache.k.shape} and {cache.v.shape}")
    _, num_heads, head_dim = q.shape
    num_kv_heads, kv_head_dim = cache.k.shape[3:]
    if kv_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {kv_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
    if cache.k.dtype != cache.v.dtype or cache.k.dtype not in (
            kv_storage_dtype(n) for n in KV_CACHE_DTYPES[1:]):
        raise ValueError(f"cache k and v must share a dtype of {', '.join(KV_CACHE_DTYPES[1:])}; "
                         f"got k {cache.k.dtype}, v {cache.v.dtype}")
    want = cache.k.shape[:4] if cache.k.dtype in QUANTIZED_KV else None
    got = tuple(None if x is None else x.shape for x in (cache.k_scale, cache.v_scale))
    if got != (want, want):
        raise ValueError(f"{cache.k.dtype} pages need scales of shape {want}; got (k, v) {got}")
    for name in ("query_start_loc", "kv_lens", "page_tables", "positions", "token_seq"):
        if getattr(md, name).dtype != jnp.int32:
            raise ValueError(f"md.{name} must be int32, got {getattr(md, name).dtype}")
    num_seqs = md.kv_lens.shape[0]
    if md.query_start_loc.shape != (num_seqs + 1,) or md.page_tables.ndim != 2 \
            or md.page_tables.shape[0] != num_seqs or num_seqs == 0:
        raise ValueError(f"metadata shapes disagree: query_start_loc {md.query_start_loc.shape}, "
                         f"kv_lens {md.kv_lens.shape}, page_tables {md.page_tables.shape}")
    if md.positions.shape != q.shape[:1] or md.token_seq.shape != q.shape[:1]:
        raise ValueError(f"positions {md.positions.shape} and token_seq {md.token_seq.shape} "
                         f"must have one entry per query row ({q.shape[0]})")


def num_work_items(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """A static bound on the work items of `work_items`: cdiv(T, block_q) + S."""
    return -(-num_tokens // block_q) + num_seqs


def work_items(md: AttentionMetadata, num_tokens: int, block_q: int):
    """The kernels' unit of work: each sequence's query rows cut into items of up to
    `block_q` rows of that one sequence (`num_work_items` of them, the spare ones empty).

    Returns per item ([W] int32 each): its sequence, first query row, that row's position
    in the sequence and its number of real rows; and per query row ([T] each) the item
    holding it, its row within the item and whether it is real (for gathering a padded
    [W, block_q, ...] output back to [T, ...]).
    """
    num_seqs = md.kv_lens.shape[0]
    num_items = num_work_items(num_tokens, num_seqs, block_q)
    starts = md.query_start_loc
    q_lens = starts[1:] - starts[:-1]
    blocks = (q_lens + block_q - 1) // block_q
    items_end = jnp.cumsum(blocks).astype(jnp.int32)
    items_start = items_end - blocks
    item = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.searchsorted(items_end, item, side="right").astype(jnp.int32)
    spare = seq >= num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    offset = (item - items_start[seq]) * block_q  # of the item's first row within the sequence
    first_row = starts[seq] + offset
    first_pos = md.kv_lens[seq] - q_lens[seq] + offset
    num_rows = jnp.where(spare, 0, jnp.clip(q_lens[seq] - offset, 0, block_q)).astype(jnp.int32)

    valid = md.token_seq >= 0
    row_seq = jnp.maximum(md.token_seq, 0)
    row_offset = jnp.arange(num_tokens, dtype=jnp.int32) - starts[row_seq]
    row_item = jnp.clip(items_start[row_seq] + row_offset // block_q, 0, num_items - 1)
    return (seq, first_row, first_pos, num_rows), (row_item, row_offset % block_q, valid)


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
       the 2-core CPU (a 64-row decode at 192 keys, SmolLM2 heads: 4.8 ms a layer at 16 rows
       x 64 keys, 10.7 ms at 64 x 256): the gathered K/V of a block stay in cache. Blocks
       of 64 keys were also the fastest at 2 to 8 rows (30 layers of an 8-row decode at
       192 keys: 11.7 ms against 14.2 with 128). A lone decode takes 128 keys a block, since
       each trip of the loop has a fixed cost; but a block reads all its keys however few
       are real: 30 layers at 80 keys ran in 1.1 ms with 128-key blocks against 3.7 ms with
       512, and at 1,024 to 2,000 keys the two were within 10%. For a lone row the scores
       are laid out [Hkv, n, G] so that the keys are the left operand of both dots (30
       layers at 1,024 keys: 5.4 against 6.6 ms); at more rows that layout was slower.

    The running output is kept normalized (divided by its softmax sum after each block) and
    flat, [T, H * D], so what leaves the loops is the very matrix the output projection
    reads. XLA:CPU computes a one-row matmul as a loop into which it fuses the elementwise
    producers of the row, reshapes included: an output divided after the loop, or reshaped
    from [T, Hkv, G, D], was recomputed with index arithmetic for every weight row, and a
    lone decode's output projection took 200 us a layer instead of 47 (c=1: 27 -> 22 ms
    a token; docs/performance.md).
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


def _pallas_gpu(*args, **kw):
    from ops.pallas_gpu_attention import pallas_gpu_ragged_paged_attention

    return pallas_gpu_ragged_paged_attention(*args, **kw)


def _pallas_tpu(*args, **kw):
    from ops.pallas_tpu_attention import pallas_tpu_ragged_paged_attention

    return pallas_tpu_ragged_paged_attention(*args, **kw)


def _cpu(*args, **kw):
    from ops.cpu_attention import cpu_ragged_paged_attention

    return cpu_ragged_paged_attention(*args, **kw)


def _pallas(*args, **kw):
    """The Pallas kernel made for the platform we run on: the Mosaic TPU kernel on TPUs, the
    GPU (Triton) kernel elsewhere. Off their platform both run in Pallas interpret mode."""
    return (_pallas_tpu if jax.default_backend() == "tpu" else _pallas_gpu)(*args, **kw)


# The one place a backend name becomes an implementation (the kernels import this module,
# hence the deferred imports above).
_BACKENDS = {
    "reference": ref_ragged_paged_attention,
    "cpu": _cpu,
    "pallas": _pallas,
    "pallas-gpu": _pallas_gpu,
    "pallas-tpu": _pallas_tpu,
}
BACKENDS = ("auto", *_BACKENDS)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; "
                         f"available: {', '.join(BACKENDS)}")


# Our GPU kernel goes through Pallas's Triton lowering, which needs Ampere or newer (bf16
# tensor-core dots). It ran on Hopper (an H100, jax 0.11.2; docs/performance.md). jax 0.11
# marks that lowering deprecated in favour of Mosaic GPU, which targets Hopper and newer
# only; a Mosaic GPU kernel would be chosen here, by compute capability, once it exists.
TRITON_MIN_COMPUTE_CAPABILITY = (8, 0)


def _compute_capability(device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None for ROCm or an unknown device."""
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def resolve_backend(backend: str, device=None) -> str:
    """`auto` is the best implementation for `device` (default: the first device): the
    Mosaic TPU kernel on a TPU; the Triton kernel on an NVIDIA GPU of compute capability
    8.0 or newer (on an H100 it beat the XLA-compiled reference on every mixed batch and on
    large decode batches, see docs/performance.md); on CPU our own kernel (ops/native, where
    it could be built; Pallas only interprets there); else the reference (and on GPUs the
    Triton kernel does not serve: older NVIDIA, ROCm)."""
    check_backend(backend)
    if backend != "auto":
        return backend
    device = device if device is not None else jax.devices()[0]
    if device.platform == "tpu":
        return "pallas-tpu"
    if device.platform == "cpu":
        from ops import native

        return "cpu" if native.available() else "reference"
    cc = _compute_capability(device)
    return "pallas-gpu" if cc is not None and cc >= TRITON_MIN_COMPUTE_CAPABILITY else "reference"


def ragged_paged_attention(q, cache, layer, md, *, sm_scale, sliding_window=None,
                           soft_cap=None, backend: str = "reference", mesh=None,
                           batch_invariant: bool = False):
    """The one attention op the model calls; `backend` picks the implementation. Under a
    tensor-parallel `mesh` it runs per shard (Pallas kernels are not partitioned by XLA):
    each device attends its own query heads over its own KV heads. `batch_invariant`: our
    CPU kernel never cuts a lone decode by keys, so a row's output does not depend on the
    rest of its step."""
    backend = resolve_backend(backend)
    extra = {"split": not batch_invariant} if backend == "cpu" else {}
    impl = functools.partial(_BACKENDS[backend], sm_scale=sm_scale,
                             sliding_window=sliding_window, soft_cap=soft_cap, **extra)
    return _per_shard(impl, mesh, (_HEADS, kv_specs(cache.quantized), P(), P()), _HEADS)(
        q, cache, layer, md)
