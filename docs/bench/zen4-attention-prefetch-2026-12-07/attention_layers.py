"""30 layers of the CPU attention kernel as the default model's decode calls it, each after a
read of 3.6 MB standing for the layer's weights, in one jit with XLA's threads (the record
behind docs/performance-log.md, "A decode's keys asked for ahead", 2026-12-07).

    PYTHONPATH=CHECKOUT python attention_layers.py ROWS KEYS SPLIT(1|0)
"""
import sys, time
import numpy as np, jax, jax.numpy as jnp
from ops.attention import AttentionMetadata
from ops.cpu_attention import cpu_ragged_paged_attention as kernel
from ops.kv_cache import KVCache
T = int(sys.argv[1]); kv = int(sys.argv[2]); SPLIT = sys.argv[3] == "1"
L, H, Hkv, D, page = 30, 9, 3, 64, 16
P = 2142  # the default pool's pages
rng = np.random.default_rng(0)
k = jnp.asarray(rng.standard_normal((L, P, page, Hkv, D)), jnp.float16)
v = jnp.asarray(rng.standard_normal((L, P, page, Hkv, D)), jnp.float16)
cache = KVCache(k, v)
npages = -(-kv // page); maxp = 128
table = np.zeros((1, maxp), np.int32); table[0, :npages] = rng.choice(np.arange(1, P), npages, replace=False)
md = AttentionMetadata(slot_mapping=jnp.zeros(T, jnp.int32), query_start_loc=jnp.asarray([0, T], jnp.int32),
                       kv_lens=jnp.asarray([kv], jnp.int32), page_tables=jnp.asarray(table),
                       positions=jnp.arange(kv - T, kv, dtype=jnp.int32), token_seq=jnp.zeros(T, jnp.int32))
q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
w = jnp.asarray(rng.standard_normal((L, 900_000)), jnp.float32)  # 3.6 MB a layer
@jax.jit
def f(q, cache, md, w):
    def body(carry, l):
        x = carry + jnp.sum(w[l]) * 1e-30
        o = kernel(x, cache, l, md, sm_scale=0.125, split=SPLIT)
        return o, None
    return jax.lax.scan(body, q, jnp.arange(L))[0]
@jax.jit
def g(q, cache, md, w):
    def body(carry, l):
        return carry + jnp.sum(w[l]) * 1e-30, None
    return jax.lax.scan(body, q, jnp.arange(L))[0]
for fn in (f, g): fn(q, cache, md, w).block_until_ready()
best = {}
for r in range(5):
    for name, fn in (("attn+w", f), ("w", g)):
        t = time.perf_counter()
        for _ in range(50): fn(q, cache, md, w).block_until_ready()
        best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) / 50 * 1e3)
print(f"T={T} kv={kv}: attention {best['attn+w'] - best['w']:.3f} ms a step ({best['attn+w']:.3f} with reads, {best['w']:.3f} reads alone)")
