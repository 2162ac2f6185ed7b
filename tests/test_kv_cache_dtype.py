"""`--kv-cache-dtype`: KV pages held in float16 / bfloat16 / float32, read by every attention
backend in their stored dtype and computed in the compute dtype; the engine's writes,
prefix-cache hits and preemption give the tokens of one plain decode with pages of the
same dtype."""

from __future__ import annotations

import dataclasses
import random
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import LAYER, make_case, oracle, reference, rel_err

from engine.config import KV_CACHE_DTYPES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from ops import kv_cache, native
from ops.cpu_attention import cpu_ragged_paged_attention
from ops.kv_cache import KVCache, resolve_kv_dtype
from ops.pallas_gpu_attention import pallas_gpu_ragged_paged_attention
from ops.pallas_tpu_attention import pallas_tpu_ragged_paged_attention
from ops.reference_attention import ref_ragged_paged_attention


def test_engine_offers_the_kv_cache_dtypes():
    assert KV_CACHE_DTYPES == kv_cache.KV_CACHE_DTYPES


def test_auto_and_refusals_by_platform():
    assert resolve_kv_dtype("auto", jnp.float32, "cpu") == jnp.float16
    assert resolve_kv_dtype("auto", jnp.bfloat16, "gpu") == jnp.bfloat16
    assert resolve_kv_dtype("auto", jnp.bfloat16, "tpu") == jnp.bfloat16
    assert resolve_kv_dtype("float32", jnp.bfloat16, "gpu") == jnp.float32
    assert resolve_kv_dtype("bfloat16", jnp.bfloat16, "gpu") == jnp.bfloat16
    with pytest.raises(ValueError, match="not supported on CPU.*float16"):
        resolve_kv_dtype("bfloat16", jnp.float32, "cpu")
    with pytest.raises(ValueError, match="fp8 is not supported on CPU"):
        resolve_kv_dtype("fp8", jnp.float32, "cpu")
    assert resolve_kv_dtype("fp8", jnp.bfloat16, "gpu") == jnp.float8_e4m3fn
    assert resolve_kv_dtype("int8", jnp.float32, "cpu") == jnp.int8
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int3'"):
        resolve_kv_dtype("int3", jnp.float32, "cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m.gguf", kv_cache_dtype="fp4")


KERNELS = {
    "reference": reference,
    "cpu": cpu_ragged_paged_attention,
    "pallas-gpu": pallas_gpu_ragged_paged_attention,  # interpreted on CPU
    "pallas-tpu": pallas_tpu_ragged_paged_attention,  # interpreted on CPU
}


def _page_size(kernel: str, kv_dtype) -> int:
    """16-token pages, but 32 for 8-bit pages in the TPU kernel (whole packed sublane tiles)."""
    return 32 if kernel == "pallas-tpu" and jnp.dtype(kv_dtype).itemsize == 1 else 16


@pytest.mark.parametrize("kernel, kv_dtype", [
    ("reference", "float16"), ("reference", "bfloat16"), ("reference", "float8_e4m3fn"),
    *(pytest.param("cpu", t, marks=pytest.mark.skipif(not native.available("attention"),
                                                     reason="CPU kernels unavailable"))
      for t in ("float16", "bfloat16")),  # fp8: refused on CPU (above)
    ("pallas-gpu", "float16"), ("pallas-gpu", "bfloat16"), ("pallas-gpu", "float8_e4m3fn"),
    ("pallas-tpu", "bfloat16"), ("pallas-tpu", "float8_e4m3fn"),  # float16: refused, below
])
def test_attention_reads_pages_in_their_dtype(kernel, kv_dtype):
    case = make_case("mixed", num_kv_heads=2, group=2, head_dim=64,
                     page_size=_page_size(kernel, kv_dtype))
    low = KVCache(case.cache.k.astype(kv_dtype), case.cache.v.astype(kv_dtype))
    widened = KVCache(low.k.astype(jnp.float32), low.v.astype(jnp.float32))
    out = KERNELS[kernel](case.q, low, LAYER, case.md, sm_scale=0.125)
    assert out.dtype == jnp.float32  # computed in q's dtype, not the pages'
    # The same values in float32 pages, through the float64 oracle: only summation differs.
    want = oracle(case.q, widened, LAYER, case.md, sm_scale=0.125)
    assert rel_err(out, want) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[case.num_real_rows:], 0.0)


def test_tpu_kernel_refuses_float16_pages():
    case = make_case("mixed", num_kv_heads=2, group=2, head_dim=64, page_size=16)
    low = KVCache(case.cache.k.astype(jnp.float16), case.cache.v.astype(jnp.float16))
    with pytest.raises(ValueError, match="float16 KV pages are not supported by the TPU kernel"):
        KERNELS["pallas-tpu"](case.q, low, LAYER, case.md, sm_scale=0.125)


@pytest.mark.parametrize("kernel", [
    "reference", "pallas-gpu", "pallas-tpu",
    pytest.param("cpu", marks=pytest.mark.skipif(not native.available("attention"),
                                                 reason="CPU kernels unavailable"))])
def test_int8_pages_round_trip_through_writes_with_their_scales(kernel):
    """int8 pages hold each written token's K/V to within half a step of its own scale (max |x|
    / 127 per token and KV head), and attention over them (the reference, the CPU kernel and
    the Pallas GPU and TPU kernels; interpreted off their device; 32-token pages, the TPU
    kernel's least for 8-bit pages) equals attention over the dequantized values in float32
    pages."""
    case = make_case("mixed", num_kv_heads=2, group=2, head_dim=64, page_size=32)
    shape = case.cache.k.shape
    cache = KVCache.zeros(*shape, jnp.int8)
    assert cache.quantized and cache.k_scale.shape == shape[:4]
    rows = np.arange(shape[1] * shape[2], dtype=np.int32)[shape[2]:]  # every slot past page 0
    page, offset = rows // shape[2], rows % shape[2]
    k, v = case.cache.k[LAYER, page, offset], case.cache.v[LAYER, page, offset]  # [N, Hkv, D]
    cache = kv_cache.write_kv(cache, LAYER, k, v, jnp.asarray(rows))
    back = np.asarray(cache.k[LAYER, page, offset], np.float32) * np.asarray(
        cache.k_scale[LAYER, page, offset])[..., None]
    step = np.abs(np.asarray(k)).max(-1, keepdims=True) / 127
    assert np.all(np.abs(back - np.asarray(k)) <= step / 2 + 1e-6)
    dequantized = KVCache(*(kv_cache.read_kv(x, s, jnp.float32) for x, s in (
        (cache.k, cache.k_scale), (cache.v, cache.v_scale))))
    wrote = KVCache(case.cache.k.at[LAYER, page, offset].set(k),
                    case.cache.v.at[LAYER, page, offset].set(v))
    out = KERNELS[kernel](case.q, cache, LAYER, case.md, sm_scale=0.125)
    assert rel_err(out, oracle(case.q, dequantized, LAYER, case.md, sm_scale=0.125)) < 1e-5
    assert rel_err(out, oracle(case.q, wrote, LAYER, case.md, sm_scale=0.125)) < 2e-2
    np.testing.assert_array_equal(np.asarray(out)[case.num_real_rows:], 0.0)
    with pytest.raises(ValueError, match="need scales"):
        ref_ragged_paged_attention(case.q, KVCache(cache.k, cache.v), LAYER, case.md,
                                   sm_scale=0.125)


WORDS = "the a sea light keeper engine never sleeps tide stone harbour night".split()


@pytest.mark.parametrize("kv_dtype, quantization", [
    pytest.param("float32", "auto", marks=pytest.mark.slow),  # CPU's default is float16
    ("float16", "auto"),
    # int8 pages: the same bookkeeping; their writes, scales and reads are the tests above
    pytest.param("int8", "auto", marks=pytest.mark.slow),
    # int8 activations: each row quantized on its own, batch-invariant (its products in the
    # engine: test_tensor_parallel's w8a8 split and test_quantization)
    pytest.param("float16", "w8a8", marks=pytest.mark.slow),
])
def test_engine_writes_prefix_hits_and_preemption_equal_plain_decode(default_gguf, kv_dtype,
                                                                      quantization):
    from flax import nnx

    from models.generate import GreedyDecoder

    rng = random.Random(0)
    shared = " ".join(rng.choice(WORDS) for _ in range(60))
    prompts = [shared + f" {w}" for w in WORDS[:4]] + [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(4)]
    # 17 pages: one 256-token sequence's 16 and the reserved page, far less than eight
    # sequences need together, so steps preempt.
    cfg = EngineConfig(model=str(default_gguf), dtype="float32", kv_cache_dtype=kv_dtype,
                       quantization=quantization, max_model_len=256, max_num_seqs=8,
                       max_num_batched_tokens=64, num_blocks=17)
    engine = LLMEngine(cfg)
    assert engine.runner.kv.k.dtype == jnp.dtype(kv_dtype)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = engine.generate(prompts, p)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_cache_hits > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    model = nnx.merge(engine.runner.graphdef, engine.runner.state)
    assert model.int8_activations == (quantization == "w8a8")
    plain = GreedyDecoder(model, max_len=256, kv_dtype=kv_dtype)
    # int8 activations: attention sums in another order at another step shape, a value a
    # float rounding from an int8 step boundary rounds the other way, and each such step
    # moves the values after it enough to flip more: the two runs end up with different
    # draws of w8a8's rounding noise (KL 1.5e-2 from the float model). Four of these eight
    # prompts part, our token within 0.39 of plain's best and among its top 3.
    # int8 pages: a K/V value a float rounding from an int8 step boundary rounds the other
    # way when the two runs sum a matmul in another order (the CPU kernel at up to 8 rows,
    # XLA above), moving later logits by up to ~1e-2 (a 5.3e-3 tie parted one prompt).
    close, tie = ((3, 0.5) if quantization == "w8a8" else
                  (2, 1e-2) if kv_dtype == "int8" else (2, 1e-3))
    for out in outs:
        want, logits = plain.generate(out.prompt_token_ids, p.max_tokens)
        got = out.outputs[0].token_ids
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:  # only at a near-tie, and only after which the two may part
                ranked = np.argsort(logits[i])[::-1]
                assert a in ranked[:close] and logits[i][b] - logits[i][a] < tie
                break


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise: Linux only")
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_new_pool_holds_no_memory_until_steps_write_it(dtype):
    """KVCache.zeros hands its pages back to the OS (kv_cache.untouched): a 256 MiB pool adds
    far less to the resident set, reads as zeros, and a step that donates it writes in place,
    faulting in only what it writes."""
    import jax

    def resident_mib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    before = resident_mib()
    bytes_per = jnp.dtype(dtype).itemsize
    pages = 256 * 2**20 // (2 * 4 * 16 * 4 * 64 * bytes_per)
    pool = kv_cache.KVCache.zeros(4, pages, 16, 4, 64, dtype)
    assert resident_mib() - before < 64  # 256 MiB of pages (and int8's scales) made
    assert not np.asarray(pool.k[1, pages - 1]).any() and not np.asarray(pool.v[3, 7]).any()
    start = pool.k.unsafe_buffer_pointer()
    write = jax.jit(lambda kv: dataclasses.replace(kv, k=kv.k.at[:, 5].set(1)), donate_argnums=0)
    pool = write(pool)
    assert pool.k.unsafe_buffer_pointer() == start  # in place
    assert resident_mib() - before < 64
    assert np.asarray(pool.k[2, 5]).all() and not np.asarray(pool.k[2, 6]).any()


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32", "int8", "fp8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_write_kv_puts_each_row_at_its_slot_and_nothing_else(kv_dtype, rows):
    # One row is an update in place (no bounds-checked scatter: two kernels fewer a layer on
    # a GPU), more rows a scatter; both leave every other slot and layer as they were.
    rng = np.random.default_rng(rows)
    layers, pages, page, heads, dim = 3, 5, 4, 2, 8
    dtype = resolve_kv_dtype(kv_dtype, jnp.float32, "gpu")
    cache = KVCache.zeros(layers, pages, page, heads, dim, dtype)
    cache = dataclasses.replace(cache, **{f: getattr(cache, f) + 0.5 for f in ("k", "v")}) \
        if not cache.quantized else cache
    k = jnp.asarray(rng.standard_normal((rows, heads, dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((rows, heads, dim)), jnp.float32)
    slots = jnp.asarray(rng.choice(pages * page, rows, replace=False), jnp.int32)
    out = kv_cache.write_kv(cache, jnp.int32(1), k, v, slots)
    p, o = np.asarray(slots) // page, np.asarray(slots) % page
    stored = (kv_cache.quantize_kv(k), kv_cache.quantize_kv(v)) if cache.quantized else None
    for name, x in (("k", k), ("v", v)):
        want = np.array(getattr(cache, name)).copy()
        if cache.quantized:
            want[1, p, o] = np.asarray(stored[name == "v"][0])
        else:
            want[1, p, o] = np.asarray(kv_cache._stored(x, getattr(cache, name).dtype))
        np.testing.assert_array_equal(np.asarray(getattr(out, name)), want)
    if cache.quantized:
        for name, (_, s) in (("k_scale", stored[0]), ("v_scale", stored[1])):
            want = np.array(getattr(cache, name)).copy()
            want[1, p, o] = np.asarray(s)
            np.testing.assert_array_equal(np.asarray(getattr(out, name)), want)
