"""Ragged paged attention: the step's attention metadata, the checks and work items every
kernel shares, the backend table, and the one entry point the model calls.

One step is a ragged batch: T query tokens from S sequences laid end to end (prefill
chunks and single decode tokens mixed). Sequence s owns query rows
`query_start_loc[s]:query_start_loc[s+1]`; its KV (history plus this step's tokens) is
`kv_lens[s]` long and lives in the pages listed by `page_tables[s]` (ops/kv_cache.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ops.kv_cache import KV_CACHE_DTYPES, QUANTIZED_KV, KVCache, kv_specs, kv_storage_dtype
from ops.shard import HEADS, per_shard


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
    # `work_items(self, T, work_block_q)`, computed once a step by `prepare` where the backend
    # cuts rows into items (a layer would otherwise compute them again: XLA:GPU kept them
    # inside the layers' loop, a kernel a layer); None elsewhere.
    work: tuple | None = None
    work_block_q: int = dataclasses.field(default=0, metadata=dict(static=True))


@functools.partial(jax.jit, static_argnames="num_tokens")
def row_layout(query_start_loc, kv_lens, num_tokens: int):
    """`(positions, token_seq)` of `AttentionMetadata` from the per-sequence arrays (tests,
    single-sequence decoding); the engine fills them on the host instead. Compiled as one
    program: op by op, its dozen small ops each compiled for every new shape."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start_loc, rows, side="right").astype(jnp.int32) - 1
    num_seqs = kv_lens.shape[0]
    valid = (seq >= 0) & (seq < num_seqs) & (rows < query_start_loc[-1])
    seq = jnp.clip(seq, 0, num_seqs - 1)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    # Query rows are the last q_len positions of the sequence's KV.
    pos = kv_lens[seq] - q_len + (rows - query_start_loc[seq])
    return jnp.where(valid, pos, 0).astype(jnp.int32), jnp.where(valid, seq, -1).astype(jnp.int32)


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
    if md.work is not None and md.work_block_q == block_q:
        return md.work
    return _compute_work_items(md, num_tokens, block_q)


def _compute_work_items(md: AttentionMetadata, num_tokens: int, block_q: int):
    num_seqs = md.kv_lens.shape[0]
    num_items = num_work_items(num_tokens, num_seqs, block_q)
    starts = md.query_start_loc
    q_lens = starts[1:] - starts[:-1]
    blocks = (q_lens + block_q - 1) // block_q
    items_end = jnp.cumsum(blocks).astype(jnp.int32)
    items_start = items_end - blocks
    item = jnp.arange(num_items, dtype=jnp.int32)
    # Every item against every sequence's end at once: jnp.searchsorted's default is a loop
    # of log2(S) steps, which XLA:GPU ran from the host inside every layer (at 64 sequences
    # ~14 small launches a layer and a step's device ~30 % idle on an H200:
    # docs/performance-log.md, "The kit on an H200, traced").
    seq = jnp.searchsorted(items_end, item, side="right", method="compare_all").astype(jnp.int32)
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


def prepare(md: AttentionMetadata, *, backend: str, num_tokens: int, num_heads: int,
            num_kv_heads: int) -> AttentionMetadata:
    """`md` with what the backend's kernel derives from it alone computed once, for every
    layer of a step to share (the GPU kernel's work items); `md` itself elsewhere."""
    if resolve_backend(backend) != "pallas-gpu":
        return md
    from ops.pallas_gpu_attention import block_q_for

    block_q = block_q_for(num_tokens, md.kv_lens.shape[0], num_heads, num_kv_heads)
    return dataclasses.replace(md, work=work_items(md, num_tokens, block_q),
                               work_block_q=block_q)


def _reference(*args, **kw):
    from ops.reference_attention import ref_ragged_paged_attention

    return ref_ragged_paged_attention(*args, **kw)


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
    "reference": _reference,
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

        return "cpu" if native.available("attention") else "reference"
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
    return per_shard(impl, mesh, (HEADS, kv_specs(cache.quantized), P(), P()), HEADS)(
        q, cache, layer, md)
