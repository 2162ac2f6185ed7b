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
