"""30 layers of the CPU attention kernel as the default model's decode calls it, each after a
read of 3.6 MB standing for the layer's weights, in one jit with XLA's threads (the record
behind docs/performance-log.md, "A decode's keys asked for ahead", 2026-12-07).

    PYTHONPATH=CHECKOUT python attention_layers.py ROWS KEYS SPLIT(1|0)
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ops.attention import AttentionMetadata
from ops.cpu_attention import cpu_ragged_paged_attention as kernel
from ops.kv_cache import KVCache

T, KV, SPLIT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
L, H, HKV, D, PAGE = 30, 9, 3, 64, 16
P = 2142  # the default pool's pages
rng = np.random.default_rng(0)
k = jnp.asarray(rng.standard_normal((L, P, PAGE, HKV, D)), jnp.float16)
v = jnp.asarray(rng.standard_normal((L, P, PAGE, HKV, D)), jnp.float16)
cache = KVCache(k, v)
npages = -(-KV // PAGE)
table = np.zeros((1, 128), np.int32)
table[0, :npages] = rng.choice(np.arange(1, P), npages, replace=False)
md = AttentionMetadata(
    slot_mapping=jnp.zeros(T, jnp.int32), query_start_loc=jnp.asarray([0, T], jnp.int32),
    kv_lens=jnp.asarray([KV], jnp.int32), page_tables=jnp.asarray(table),
    positions=jnp.arange(KV - T, KV, dtype=jnp.int32), token_seq=jnp.zeros(T, jnp.int32))
q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
w = jnp.asarray(rng.standard_normal((L, 900_000)), jnp.float32)  # 3.6 MB a layer


@jax.jit
def with_attention(q, cache, md, w):
    def body(carry, layer):
        x = carry + jnp.sum(w[layer]) * 1e-30
        return kernel(x, cache, layer, md, sm_scale=0.125, split=SPLIT), None
    return jax.lax.scan(body, q, jnp.arange(L))[0]


@jax.jit
def reads_alone(q, cache, md, w):
    def body(carry, layer):
        return carry + jnp.sum(w[layer]) * 1e-30, None
    return jax.lax.scan(body, q, jnp.arange(L))[0]


for fn in (with_attention, reads_alone):
    fn(q, cache, md, w).block_until_ready()
best = {}
for _ in range(5):
    for name, fn in (("both", with_attention), ("reads", reads_alone)):
        start = time.perf_counter()
        for _ in range(50):
            fn(q, cache, md, w).block_until_ready()
        best[name] = min(best.get(name, 1e9), (time.perf_counter() - start) / 50 * 1e3)
print(f"T={T} kv={KV}: attention {best['both'] - best['reads']:.3f} ms a step "
      f"({best['both']:.3f} with reads, {best['reads']:.3f} reads alone)")
