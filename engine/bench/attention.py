"""Ragged paged attention benchmark: `python -m engine.bench.attention`.

Times the attention implementations on identical inputs (one layer's pages, random
values, pages handed out in random order) for

- decode batches: every sequence one query token, batch x context over a grid; and
- mixed batches: one prefill chunk plus decodes, as the engine schedules them.

For each case it prints the time (median of `--repeats` runs after warmup), the KV bytes
the op must read at least once (K and V of every visible position) over that time, and that
rate as a fraction of the device's copy bandwidth measured in the same run (bytes read plus
bytes written of a large device-to-device copy). Every implementation's output is first
checked against the pure-JAX reference (relative error column), so a fast wrong kernel
shows up as wrong; "ours x" is a row's time over our kernel's (above 1: ours is faster).
Comparisons: the reference op compiled by XLA, and on decode batches JAX's bundled Pallas
GPU paged attention (`jax.experimental.pallas.ops.gpu.paged_attention`, decode only, its own
page layout prepared outside the timed region).

`--smoke` runs tiny shapes in Pallas interpret mode on CPU (the CI smoke test); its times
are meaningless. Real numbers come from a GPU (or TPU) only.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ops.attention import BACKENDS, AttentionMetadata, ragged_paged_attention, row_layout
from ops.kv_cache import KVCache

LLAMA3_8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
ROTATE_BYTES = 512 << 20  # rotate among input sets until they exceed any cache (H100 L2: 50 MB)


# ---- inputs ------------------------------------------------------------------------------


def make_inputs(seqs: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int,
                head_dim: int, page_size: int, dtype, seed: int):
    """q, a one-layer cache and metadata for sequences given as (q_len, kv_len)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = [-(-kv // page_size) for _, kv in seqs]
    max_pages = max(pages_per_seq)
    num_pages = 1 + sum(pages_per_seq)
    order = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_tables = np.zeros((len(seqs), max_pages), np.int32)
    start = 0
    for s, n in enumerate(pages_per_seq):
        page_tables[s, :n] = order[start:start + n]
        start += n
    q_lens = [q for q, _ in seqs]
    num_tokens = sum(q_lens)
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    shape = (1, num_pages, page_size, num_kv_heads, head_dim)
    cache = KVCache(jax.random.normal(key_k, shape, dtype), jax.random.normal(key_v, shape, dtype))
    q = jax.random.normal(key_q, (num_tokens, num_heads, head_dim), dtype)
    query_start_loc = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    kv_lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    # Each row's slot: its K/V sit in the cache already, as after the model's write_kv.
    slots = np.concatenate([page_tables[s, p // page_size] * page_size + p % page_size
                            for s, (q_len, kv) in enumerate(seqs)
                            for p in [np.arange(kv - q_len, kv)]]).astype(np.int32)
    positions, token_seq = row_layout(query_start_loc, kv_lens, num_tokens)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots), query_start_loc=query_start_loc, kv_lens=kv_lens,
        page_tables=jnp.asarray(page_tables),
        positions=positions, token_seq=token_seq,
    )
    return q, cache, md


def kv_bytes_read(seqs, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """The least KV traffic: K and V of each sequence's positions, read once."""
    return sum(kv for _, kv in seqs) * 2 * num_kv_heads * head_dim * itemsize


def attention_flops(seqs, num_heads: int, head_dim: int) -> int:
    """Two matmuls (QK^T and PV) over each query row's causally visible keys."""
    visible = sum(sum(kv - q + i + 1 for i in range(q)) for q, kv in seqs)
    return 4 * visible * num_heads * head_dim


# ---- implementations -----------------------------------------------------------------------


def _ours(backend: str):
    def run(q, cache, md):
        return ragged_paged_attention(q, cache, 0, md, sm_scale=q.shape[-1] ** -0.5,
                                      backend=backend)
    return jax.jit(run)


def _bundled_gpu(interpret: bool):
    """JAX's bundled Pallas GPU paged attention (decode only), on its own KV layout."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    def prepare(q, cache, md):
        if int(md.query_start_loc[-1]) != md.kv_lens.shape[0]:
            return None  # not a decode batch
        to_heads_first = lambda x: jnp.transpose(x[0], (2, 0, 1, 3))  # [Hkv, P, page, D]
        pages = md.page_tables.shape[1]
        k_splits = max(d for d in (16, 8, 4, 2, 1) if pages % d == 0)
        per_block = max(d for d in (8, 4, 2, 1) if (pages // k_splits) % d == 0)
        fn = jax.jit(functools.partial(paged_attention, k_splits=k_splits,
                                       pages_per_compute_block=per_block, interpret=interpret))
        k, v = to_heads_first(cache.k), to_heads_first(cache.v)
        q_scaled = q * q.shape[-1] ** -0.5  # it applies no softmax scale of its own
        return lambda: fn(q_scaled, k, v, md.page_tables, md.kv_lens)

    return prepare


def implementations(names: list[str], interpret: bool) -> dict:
    """name -> prepare(q, cache, md) returning a no-argument callable, or None if the
    implementation does not handle this batch."""
    impls = {}
    for name in names:
        if name == "bundled-gpu":
            impls[name] = _bundled_gpu(interpret)
        elif name in BACKENDS:
            fn = _ours(name)
            impls[name] = lambda q, cache, md, fn=fn: (lambda: fn(q, cache, md))
        else:
            raise SystemExit(f"unknown implementation {name!r}; "
                             f"available: bundled-gpu, {', '.join(BACKENDS)}")
    return impls


# ---- timing --------------------------------------------------------------------------------


def time_median(calls: list, repeats: int, warmup: int = 2) -> float:
    """Median wall time of one call, rotating over `calls` (one per input set)."""
    for call in calls[:1] * warmup:
        jax.block_until_ready(call())
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(calls[i % len(calls)]())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_ceilings(copy_bytes: int, matmul_n: int, dtype, repeats: int) -> dict:
    """Device copy bandwidth (read + write) and matmul rate, measured the same way."""
    x = jnp.ones((copy_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda x: x + 1)
    t_copy = time_median([lambda: copy(x)], repeats)
    a = jax.random.normal(jax.random.key(1), (matmul_n, matmul_n), dtype)
    mm = jax.jit(lambda a: a @ a)
    t_mm = time_median([lambda: mm(a)], repeats)
    return {"copy_bytes_per_s": 2 * x.nbytes / t_copy,
            "matmul_flops_per_s": 2 * matmul_n ** 3 / t_mm,
            "copy_bytes": x.nbytes, "matmul_shape": [matmul_n] * 3, "matmul_dtype": str(dtype)}


def rel_err(out, ref) -> float:
    out, ref = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (out, ref))
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


# ---- cases ---------------------------------------------------------------------------------


def cases(args) -> list[tuple[str, list[tuple[int, int]]]]:
    out = []
    for ctx in args.contexts:
        for batch in args.batches:
            out.append((f"decode b={batch} ctx={ctx}", [(1, ctx)] * batch))
    for ctx in args.contexts:
        for decodes in args.mixed_decodes:
            chunk = min(args.prefill_chunk, ctx)
            out.append((f"mixed {chunk}-token chunk + {decodes} decodes ctx={ctx}",
                        [(chunk, ctx)] + [(1, ctx)] * decodes))
    return out


def run_case(name, seqs, impls, args, ceilings) -> list[dict]:
    dtype = jnp.dtype(args.dtype)
    layout = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                  head_dim=args.head_dim, page_size=args.page_size, dtype=dtype)
    kv_bytes = kv_bytes_read(seqs, args.num_kv_heads, args.head_dim, dtype.itemsize)
    if kv_bytes > args.max_kv_gib * (1 << 30):
        print(f"{name}: skipped, {kv_bytes / (1 << 30):.1f} GiB of KV > --max-kv-gib")
        return []
    num_sets = 1 if args.smoke else max(1, min(8, math.ceil(ROTATE_BYTES / kv_bytes)))
    inputs = [make_inputs(seqs, **layout, seed=args.seed + i) for i in range(num_sets)]
    flops = attention_flops(seqs, args.num_heads, args.head_dim)
    reference = None
    rows = []
    for impl_name, prepare in impls.items():
        row = {"case": name, "impl": impl_name, "seqs": len(seqs),
               "query_tokens": sum(q for q, _ in seqs), "kv_bytes": kv_bytes, "flops": flops}
        try:
            calls = [prepare(*x) for x in inputs]
            if calls[0] is None:
                continue
            out = jax.block_until_ready(calls[0]())
            if reference is None:
                reference = jax.block_until_ready(
                    _ours("reference")(*inputs[0]) if impl_name != "reference" else out)
            row["rel_err"] = rel_err(out, reference)
            seconds = time_median(calls, args.repeats)
        except Exception as e:  # noqa: BLE001 -- an OOM or unsupported shape is a result
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            continue
        row.update(seconds=seconds, kv_bytes_per_s=kv_bytes / seconds,
                   copy_fraction=kv_bytes / seconds / ceilings["copy_bytes_per_s"],
                   flops_per_s=flops / seconds,
                   matmul_fraction=flops / seconds / ceilings["matmul_flops_per_s"])
        rows.append(row)
    by_impl = {r["impl"]: r for r in rows if "seconds" in r}
    ours = by_impl.get(args.ours)
    for r in rows:
        if ours is not None and "seconds" in r:
            r["ours_speedup"] = r["seconds"] / ours["seconds"]
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'case':46} {'impl':12} {'time':>10} {'KV GB/s':>8} {'of copy':>8} "
          f"{'TFLOP/s':>8} {'ours x':>7} {'rel err':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:46} {r['impl']:12} {r['error']}")
            continue
        print(f"{r['case']:46} {r['impl']:12} {r['seconds'] * 1e3:8.3f}ms "
              f"{r['kv_bytes_per_s'] / 1e9:8.1f} {r['copy_fraction']:8.1%} "
              f"{r['flops_per_s'] / 1e12:8.2f} {r.get('ours_speedup', float('nan')):7.2f} "
              f"{r['rel_err']:8.1e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes in interpret mode on CPU (a CI smoke test; no timing)")
    p.add_argument("--impls", default=None,
                   help="comma-separated: bundled-gpu and attention backends "
                        f"({', '.join(BACKENDS)}); default: per platform")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4, 16, 64, 256])
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[512, 2048, 8192, 32768])
    p.add_argument("--mixed-decodes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[15, 63], help="decode sequences next to the prefill chunk")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--num-heads", type=int, default=LLAMA3_8B["num_heads"])
    p.add_argument("--num-kv-heads", type=int, default=LLAMA3_8B["num_kv_heads"])
    p.add_argument("--head-dim", type=int, default=LLAMA3_8B["head_dim"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--max-kv-gib", type=float, default=16.0,
                   help="skip cases whose KV (per input set) is larger")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the rows and ceilings as JSON")
    args = p.parse_args(argv)

    device = jax.devices()[0]
    platform_name = jax.default_backend()
    if args.smoke:
        args.batches, args.contexts, args.mixed_decodes = [1, 3], [16, 40], [2]
        args.prefill_chunk, args.repeats = 8, 1
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 1, 64
        args.max_kv_gib = 1.0
    native = {"gpu": "pallas-gpu", "tpu": "pallas-tpu"}.get(platform_name, "pallas-gpu")
    args.ours = native
    if args.impls is None:
        names = {"gpu": [native, "bundled-gpu", "reference"],
                 "tpu": [native, "reference"]}.get(platform_name, [native, "reference"])
        if args.smoke:
            names = ["pallas-gpu", "pallas-tpu", "bundled-gpu", "reference"]
    else:
        names = args.impls.split(",")
    interpret = platform_name != "gpu"
    impls = implementations(names, interpret)

    ceilings = measure_ceilings(copy_bytes=(16 << 20) if args.smoke else (1 << 30),
                                matmul_n=256 if args.smoke else 8192,
                                dtype=jnp.dtype(args.dtype), repeats=max(3, args.repeats))
    print(f"device: {device.device_kind} ({platform_name}), jax {jax.__version__}"
          f"{', interpret mode: times are meaningless' if interpret else ''}")
    print(f"ceilings (this run): copy {ceilings['copy_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"{args.dtype} matmul {ceilings['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s")
    print(f"layout: {args.num_heads} heads, {args.num_kv_heads} KV heads, head dim "
          f"{args.head_dim}, page {args.page_size}, {args.dtype}")

    rows = []
    for name, seqs in cases(args):
        new = run_case(name, seqs, impls, args, ceilings)
        print_rows(new)
        rows += new
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": device.device_kind, "platform": platform_name,
                       "host": platform.node(), "jax": jax.__version__,
                       "interpret": interpret, "args": vars(args), "ceilings": ceilings,
                       "rows": rows}, f, indent=1)
    print("\nsummary")
    print_rows(rows)
    if args.smoke and any("error" in r for r in rows):
        print("an implementation failed", file=sys.stderr)
        return 1
    # float16 keeps 11 bits (3.2e-4 measured against the float32 reference on CPU), bfloat16 8
    tolerance = {"bfloat16": 2e-2, "float16": 2e-3}.get(args.dtype, 1e-4)
    failed = [r for r in rows if r.get("rel_err", 0.0) > tolerance]
    if failed:
        print(f"{len(failed)} results disagree with the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
