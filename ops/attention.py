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
# layer l; page 0 is a reserved dummy page that padded tokens write into.


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, P, page_size, Hkv, D]
    v: jax.Array  # [L, P, page_size, Hkv, D]

    @classmethod
    def zeros(cls, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype,
              sharding=None):
        """Zeroed pages, made directly in `sharding` (e.g. split by KV head) when given."""
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return cls(make(), make())

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
    padded tokens write to page 0 and padded sequences have no query rows."""

    slot_mapping: jax.Array     # [T] int32: page * page_size + offset for each token's new K/V
    query_start_loc: jax.Array  # [S + 1] int32: non-decreasing; padded sequences are empty
    kv_lens: jax.Array          # [S] int32: KV length of each sequence including this step
    page_tables: jax.Array      # [S, max_pages] int32: page ids; unused entries point at page 0


def _per_shard(fn, mesh, in_specs, out_specs):
    """`fn` on each device's heads under `shard_map` when `mesh` splits them; else `fn`."""
    if mesh is None or mesh.shape.get(TENSOR_AXIS, 1) == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


_HEADS = P(None, TENSOR_AXIS, None)                 # q, k, v, outputs: [T, heads, D]
_KV_PAGES = P(None, None, None, TENSOR_AXIS, None)  # [L, P, page, Hkv, D]


def write_kv(cache: KVCache, layer, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, mesh=None) -> KVCache:
    """Scatter this step's K/V ([T, Hkv, D]) into layer `layer`'s pages (per shard under a
    tensor-parallel mesh: each device writes its own KV heads)."""
    kv_specs = KVCache(_KV_PAGES, _KV_PAGES)
    return _per_shard(_write_kv, mesh, (kv_specs, P(), _HEADS, _HEADS, P()), kv_specs)(
        cache, layer, k, v, slot_mapping)


def _write_kv(cache: KVCache, layer, k, v, slot_mapping) -> KVCache:
    page_size = cache.page_size
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    return KVCache(
        cache.k.at[layer, pages, offsets].set(k.astype(cache.k.dtype)),
        cache.v.at[layer, pages, offsets].set(v.astype(cache.v.dtype)),
    )


def _token_layout(md: AttentionMetadata, num_tokens: int):
    """For each query row: its sequence, its position in that sequence, and whether it is real."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(md.query_start_loc, rows, side="right").astype(jnp.int32) - 1
    num_seqs = md.kv_lens.shape[0]
    valid = (seq >= 0) & (seq < num_seqs)
    seq = jnp.clip(seq, 0, num_seqs - 1)
    q_len = md.query_start_loc[seq + 1] - md.query_start_loc[seq]
    # Query rows are the last q_len positions of the sequence's KV.
    q_pos = md.kv_lens[seq] - q_len + (rows - md.query_start_loc[seq])
    return seq, q_pos, valid & (rows < md.query_start_loc[-1])


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
    if q.dtype != cache.k.dtype or cache.k.dtype != cache.v.dtype:
        raise ValueError(f"dtypes must match: q {q.dtype}, k {cache.k.dtype}, v {cache.v.dtype}")
    for name in ("query_start_loc", "kv_lens", "page_tables"):
        if getattr(md, name).dtype != jnp.int32:
            raise ValueError(f"md.{name} must be int32, got {getattr(md, name).dtype}")
    num_seqs = md.kv_lens.shape[0]
    if md.query_start_loc.shape != (num_seqs + 1,) or md.page_tables.ndim != 2 \
            or md.page_tables.shape[0] != num_seqs or num_seqs == 0:
        raise ValueError(f"metadata shapes disagree: query_start_loc {md.query_start_loc.shape}, "
                         f"kv_lens {md.kv_lens.shape}, page_tables {md.page_tables.shape}")


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

    row_seq, _, valid = _token_layout(md, num_tokens)
    row_offset = jnp.arange(num_tokens, dtype=jnp.int32) - starts[row_seq]
    row_item = jnp.clip(items_start[row_seq] + row_offset // block_q, 0, num_items - 1)
    return (seq, first_row, first_pos, num_rows), (row_item, row_offset % block_q, valid)


def ref_ragged_paged_attention(
    q: jax.Array,          # [T, H, D]
    cache: KVCache,
    layer,                 # scalar int: which layer's pages to read
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    tokens_per_block: int = 64,
) -> jax.Array:            # [T, H, D]
    """Gather each query row's pages and run a masked softmax over them.

    Rows are processed in blocks of `tokens_per_block` so the gathered KV is
    [block, max_pages * page_size, Hkv, D] rather than [T, ...].
    """
    num_tokens, num_heads, head_dim = q.shape
    k_pages, v_pages = cache.k[layer], cache.v[layer]  # [P, page_size, Hkv, D]
    num_kv_heads = k_pages.shape[2]
    group = num_heads // num_kv_heads
    max_len = md.page_tables.shape[1] * cache.page_size
    seq, q_pos, valid = _token_layout(md, num_tokens)

    block = min(tokens_per_block, num_tokens)
    pad = -num_tokens % block
    padded = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    q_b, seq_b, pos_b, valid_b = (padded(x).reshape(-1, block, *x.shape[1:])
                                  for x in (q, seq, q_pos, valid))

    def one_block(args):
        qb, sb, pb, vb = args  # [B, H, D], [B], [B], [B]
        pages = md.page_tables[sb]  # [B, max_pages]
        kb = k_pages[pages].reshape(block, max_len, num_kv_heads, head_dim)
        vb_ = v_pages[pages].reshape(block, max_len, num_kv_heads, head_dim)
        qg = qb.reshape(block, num_kv_heads, group, head_dim).astype(jnp.float32)
        s = jnp.einsum("bkgd,blkd->bkgl", qg, kb.astype(jnp.float32)) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = jnp.arange(max_len)[None, :]
        mask = (kv_pos <= pb[:, None]) & (kv_pos < md.kv_lens[sb][:, None]) & vb[:, None]
        if sliding_window is not None:
            mask &= kv_pos > pb[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # fully masked rows -> zeros
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("bkgl,blkd->bkgd", p, vb_.astype(jnp.float32))
        o = o / jnp.where(denom > 0, denom, 1.0)
        return o.reshape(block, num_heads, head_dim)

    out = jax.lax.map(one_block, (q_b, seq_b, pos_b, valid_b))
    return out.reshape(-1, num_heads, head_dim)[:num_tokens].astype(q.dtype)


def _pallas_gpu(*args, **kw):
    from ops.pallas_gpu_attention import pallas_gpu_ragged_paged_attention

    return pallas_gpu_ragged_paged_attention(*args, **kw)


def _pallas_tpu(*args, **kw):
    from ops.pallas_tpu_attention import pallas_tpu_ragged_paged_attention

    return pallas_tpu_ragged_paged_attention(*args, **kw)


def _pallas(*args, **kw):
    """The Pallas kernel made for the platform we run on: the Mosaic TPU kernel on TPUs, the
    GPU (Triton) kernel elsewhere. Off their platform both run in Pallas interpret mode."""
    return (_pallas_tpu if jax.default_backend() == "tpu" else _pallas_gpu)(*args, **kw)


# The one place a backend name becomes an implementation (the kernels import this module,
# hence the deferred imports above).
_BACKENDS = {
    "reference": ref_ragged_paged_attention,
    "pallas": _pallas,
    "pallas-gpu": _pallas_gpu,
    "pallas-tpu": _pallas_tpu,
}
BACKENDS = tuple(_BACKENDS)


def check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; "
                         f"available: {', '.join(_BACKENDS)}")


def ragged_paged_attention(q, cache, layer, md, *, sm_scale, sliding_window=None,
                           soft_cap=None, backend: str = "reference", mesh=None):
    """The one attention op the model calls; `backend` picks the implementation. Under a
    tensor-parallel `mesh` it runs per shard (Pallas kernels are not partitioned by XLA):
    each device attends its own query heads over its own KV heads."""
    check_backend(backend)
    impl = functools.partial(_BACKENDS[backend], sm_scale=sm_scale,
                             sliding_window=sliding_window, soft_cap=soft_cap)
    kv_specs = KVCache(_KV_PAGES, _KV_PAGES)
    return _per_shard(impl, mesh, (_HEADS, kv_specs, P(), P()), _HEADS)(q, cache, layer, md)
