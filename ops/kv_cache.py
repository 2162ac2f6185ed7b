"""The KV cache: its page layout and dtypes, how a pool splits over a tensor-parallel mesh,
and writing (and reading back) one step's K/V. The one place that knows the layout.

k, v: [L, P, page_size, Hkv, D] -- layers stacked so the scanned model step indexes
layer l; page 0 is a reserved dummy page that padded tokens write into. The pages hold
K/V in their own dtype (--kv-cache-dtype); every backend reads that and computes in q's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ops.shard import HEADS, TENSOR_AXIS, per_shard

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
    float32 and back for each layer's write (with a 1,025-page pool the write took far longer
    than in float32, and attention was much slower too), while float16 runs natively
    (attention faster than float32; docs/performance-log.md, "KV pages in float16 and a KV
    budget: the default server's memory"). int8 pages (53% of float16's bytes at head_dim 64)
    passed parity and beat float32 at 64 streams on the 2-core CPU, but ran slightly slower
    than float16 and lose a little accuracy (docs/performance-log.md, "int8 KV pages"); the
    default pool is sized by a budget either way, so `auto` stays float16 and int8 is the
    smallest-footprint choice."""
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
            return untouched(cls(make(), make()))
        scale_sharding = None if sharding is None else jax.sharding.NamedSharding(
            sharding.mesh, P(*sharding.spec[:4]))
        scales = jax.jit(lambda: jnp.zeros(shape[:4], jnp.float32), out_shardings=scale_sharding)
        return untouched(cls(make(), make(), scales(), scales()))

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]


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
    return per_shard(_write_kv, mesh, (specs, P(), HEADS, HEADS, P()), specs)(
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
    if slot_mapping.shape[0] == 1:
        # One row (a lone decode): an update in place at its slot. A scatter's rows are
        # bounds-checked (an out-of-range row is dropped), which on a GPU costs two kernels
        # more a layer (the old value read and a select); every slot is in the pool (a
        # padded row's is page 0's, engine/batch.py), and the update clamps the same way.
        def put(pool, x):
            start = (layer, pages[0], offsets[0]) + (0,) * (pool.ndim - 3)
            return jax.lax.dynamic_update_slice(pool, x.astype(pool.dtype)[None, None], start)
    else:
        def put(pool, x):
            return pool.at[layer, pages, offsets].set(x.astype(pool.dtype))

    if not cache.quantized:
        return KVCache(put(cache.k, _stored(k, cache.k.dtype)),
                       put(cache.v, _stored(v, cache.v.dtype)))
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    return KVCache(put(cache.k, kq), put(cache.v, vq), put(cache.k_scale, ks),
                   put(cache.v_scale, vs))


_MADV_DONTNEED = 4


def untouched(cache: KVCache) -> KVCache:
    """`cache`'s zeroed pages, their memory handed back to the OS where the arrays live in this
    process's memory (the CPU backend on Linux): madvise(MADV_DONTNEED) on a private anonymous
    mapping leaves its pages reading as zeros and faulted in only when written, so the resident
    set grows with the tokens a step writes (steps donate the pool and write it in place), not
    with the pool's size. A no-op elsewhere. The arrays must not be in use (just made)."""
    if not sys.platform.startswith("linux") or any(
            isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(cache)):
        return cache  # elsewhere, or traced (jax.eval_shape of a pool): nothing to hand back
    page = mmap.PAGESIZE
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for array in jax.tree.leaves(cache):
        for shard in array.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            data = shard.data
            data.block_until_ready()
            start = data.unsafe_buffer_pointer()
            lo, hi = -(-start // page) * page, (start + data.nbytes) // page * page
            if hi > lo:  # whole pages only: the edges stay as they are (zeros already)
                madvise(lo, hi - lo, _MADV_DONTNEED)
    return cache
