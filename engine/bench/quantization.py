"""Quantized matmul benchmark: `python -m engine.bench.quantization`.

Times `ops.quantized_linear.linear` as the model runs it off the CPU kernel (a loop over stacked
layers, each layer's matrix sliced and multiplied), for the compute dtype's float weights,
int8 per output channel and int4 in groups of 32 with minimums (Q4_1's format), at several
row counts, on random weights of one matrix shape (default: Llama-3-8B's MLP gate/up
projection, 4096 -> 14336). Each row gives the time per layer (median of `--repeats`), the
weight bytes a layer reads over that time as a fraction of the copy bandwidth measured in
the same run, the matmul rate against the same run's matmul ceiling, the error against the
float product of the dequantized weight, and whether XLA's optimized program holds a whole
dequantized (or copied) matrix: `materialized` means the conversion was not fused into the
dot, so the weight's bytes are read, written and read again (views: parameters and bitcasts
are not counted).

The question it answers: does XLA fuse the dequantization into the dot on this
device, and at which row counts does a quantized weight still pay? `--smoke` runs tiny
shapes (CI); its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from engine.bench.attention import measure_ceilings, rel_err, time_median
from ops.pallas_gpu_matmul import stacked_matmul
from ops.quantization import QuantFormat, dequantize, held_bytes, pack, quantize
from ops.quantized_linear import linear
from ops.xla_linear import row_sums

FORMATS = {"float": None, "int8": QuantFormat(8, 0), "int4": QuantFormat(4, 32, has_min=True),
           # candidates: `row_sums` (one row on a GPU) at any row count; int4 packed two a
           # byte as a model on one GPU holds it
           "int8-reduce": QuantFormat(8, 0), "float-reduce": None,
           "int4-reduce": QuantFormat(4, 32, has_min=True, packed=True),
           # through ops/pallas_gpu_matmul (the stack and the layer index): float,
           # per-channel int8, and int4 packed two a byte (as a model on one GPU holds it)
           "float-pallas": None, "int8-pallas": QuantFormat(8, 0),
           "int4-pallas": QuantFormat(4, 32, has_min=True, packed=True)}
LAYOUTS = ("stacked", "counted", "unrolled", "separate")
ROTATE_BYTES = 512 << 20  # the float layers together exceed any cache (H200 L2: 60 MB)


def weight_bytes(w) -> int:
    """Bytes of one stack of weights as the device holds them."""
    return sum(held_bytes(a) for a in (w.values() if isinstance(w, dict) else [w]))


def make_weights(fmt: QuantFormat | None, layers: int, out_f: int, in_f: int, dtype, seed: int):
    """Random [L, O, I] weights made on the device, quantized there (as `random_model`)."""
    def init(key):
        w = jax.random.normal(key, (layers, out_f, in_f), jnp.float32) * 0.02
        if fmt is None:
            return w.astype(dtype)
        parts = quantize(w, fmt, xp=jnp)
        if fmt.packed:
            return parts | {"q": pack(parts["q"], not fmt.has_min, lanes=fmt.lanes, xp=jnp)}
        return parts | {"q": parts["q"].astype(fmt.storage_dtype())}
    return jax.jit(init)(jax.random.key(seed))


def pallas_linear(options: str = ""):
    """Weights through ops/pallas_gpu_matmul: the whole stack and the layer index.
    `options`: "BNxBKxSPLITSxWARPSxSTAGES" (0: the kernel's choice), from a format named
    float-pallas@OPTIONS."""
    names = ("block_n", "block_k", "splits", "num_warps", "num_stages")
    values = map(int, options.split("x")) if options else ()
    kwargs = {k: v for k, v in zip(names, values, strict=False) if v}

    def product(x: jax.Array, w, layer) -> jax.Array:
        stack, scale = (w["q"], w["scale"]) if isinstance(w, dict) else (w, None)
        minimum = w.get("min") if isinstance(w, dict) else None
        out_f, in_f = stack.shape[1], x.shape[1]
        fits = (out_f % kwargs.get("block_n", 1) == 0  # else (--smoke's shapes) its choice
                and in_f % (kwargs.get("block_k", 1) * kwargs.get("splits", 1)) == 0)
        return stacked_matmul(x, stack, layer, scale=scale, minimum=minimum,
                              **(kwargs if fits else {}))

    product.takes_stack = True  # layer_loop hands it the stack and the index, unsliced
    return product


def layer_loop(x: jax.Array, w, layout: str = "stacked", product=linear) -> jax.Array:
    """Sum over layers of x @ w[l]^T. `layout`: "stacked" slices each layer's matrix out of
    the [L, O, I] stack inside a scan, as models/llama.layer_params does where XLA runs the
    matmuls, at an index read from the scanned array of layer numbers; "counted" slices it
    at the loop's own counter (`fori_loop`), an offset XLA can see as the induction
    variable; "unrolled" slices it statically in an unrolled loop; "separate" takes a list
    of per-layer arrays (no slicing: the floor for the others)."""
    if layout == "separate":
        return sum(product(x, wl).astype(jnp.float32) for wl in w)
    stack = w["q"] if isinstance(w, dict) else w
    takes_stack = getattr(product, "takes_stack", False)
    if layout == "unrolled":
        return sum((product(x, w, i) if takes_stack else
                    product(x, jax.tree.map(lambda a, i=i: a[i], w))).astype(jnp.float32)
                   for i in range(stack.shape[0]))

    def body(idx, acc):
        if takes_stack:
            return acc + product(x, w, idx).astype(jnp.float32)
        wl = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, idx, 0, False), w)
        return acc + product(x, wl).astype(jnp.float32)

    acc = jnp.zeros((x.shape[0], stack.shape[1]), jnp.float32)
    if layout == "counted":
        return jax.lax.fori_loop(0, stack.shape[0], body, acc)
    return jax.lax.scan(lambda acc, idx: (body(idx, acc), None), acc,
                        jnp.arange(stack.shape[0], dtype=jnp.int32))[0]


def materialized(hlo: str, out_f: int, in_f: int) -> int:
    """Instructions of the optimized program that write a whole [O, I] (or [L, O, I])
    matrix of any dtype: a copied or converted weight (or stack of them). Only instructions
    that write memory count: those of the entry computation and of loop bodies, not the
    insides of a fusion (a multiply of the weight fused into its sum writes nothing). Views
    write nothing either: parameters, bitcasts, and constant slices (an H200 read those in
    place: an unrolled layer ran as fast as a separate array)."""
    shape = re.compile(rf"= \w+\[(?:\d+,)?{out_f},{in_f}\]\S* ([\w-]+?)\(")
    views = ("parameter", "bitcast", "get-tuple-element", "tuple", "slice")
    fused = set(re.findall(r" fusion\(.*?calls=%?([\w.-]+)", hlo))
    count, inside = 0, False
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.removeprefix("ENTRY ").split(" ")[0].lstrip("%")
            inside = name in fused  # a fusion's body: computed in registers, not written
        elif not inside and (m := shape.search(line)) and m.group(1) not in views:
            count += 1
    return count


def run(name, rows, layout, args, dtype, ceilings) -> dict:
    base, _, options = name.partition("@")
    fmt = FORMATS[base]
    w = make_weights(fmt, args.layers, args.out_features, args.in_features, dtype, args.seed)
    x = jax.random.normal(jax.random.key(args.seed + 1), (rows, args.in_features), dtype)
    product = (row_sums if base.endswith("-reduce") else
               pallas_linear(options) if base.endswith("-pallas") else linear)
    fn = jax.jit(lambda x, w: layer_loop(x, w, layout, product))
    arg = ([jax.tree.map(lambda a, i=i: a[i], w) for i in range(args.layers)]
           if layout == "separate" else w)
    out = fn(x, arg)
    dense = w if fmt is None else dequantize(w["q"], w["scale"], w.get("min"), dtype=jnp.float32)
    want = jnp.einsum("ti,loi->to", x.astype(jnp.float32), dense.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    err = rel_err(out, want)
    del dense, want
    seconds = time_median([lambda: fn(x, arg)], args.repeats) / args.layers
    nbytes = weight_bytes(w) / args.layers
    flops = 2 * rows * args.in_features * args.out_features
    hlo = fn.lower(x, arg).compile().as_text()
    if args.hlo_dir:
        Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.hlo_dir) / f"{name}-{layout}-{rows}.txt").write_text(hlo)
    row = {"format": name, "rows": rows, "layout": layout, "seconds": seconds,
           "weight_bytes": nbytes,
           "copy_fraction": nbytes / seconds / ceilings["copy_bytes_per_s"],
           "matmul_fraction": flops / seconds / ceilings["matmul_flops_per_s"],
           "rel_err": err, "materialized": materialized(hlo, args.out_features,
                                                        args.in_features)}
    print(f"{name:>11} {layout:>8} rows={rows:<4} {seconds * 1e3:8.4f} ms/layer  "
          f"{nbytes / 2**20:7.1f} MiB  copy {row['copy_fraction']:5.2f}  "
          f"matmul {row['matmul_fraction']:5.3f}  err {err:.1e}  "
          f"materialized {row['materialized']}", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.quantization",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-features", type=int, default=4096)
    ap.add_argument("--out-features", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=None,
                    help="stacked layers (default: enough that the float ones exceed 512 MiB)")
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--formats", default="float,int8,int4",
                    help=f"some of {', '.join(FORMATS)}; float-pallas@BNxBKxSPLITSxWARPSxSTAGES "
                         "(int8-pallas@...) sets the kernel's blocks (0: its choice)")
    ap.add_argument("--layouts", default="stacked", help=f"some of {', '.join(LAYOUTS)} "
                    "(layer_loop)")
    ap.add_argument("--hlo-dir", help="write each case's optimized HLO here")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on "
                                                  "accelerators, float32 on CPU)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CI)")
    ap.add_argument("--output", help="write the rows and ceilings as JSON")
    args = ap.parse_args(argv)
    if args.smoke:
        args.in_features, args.out_features, args.layers, args.repeats = 64, 96, 2, 2
        args.rows = "1,4"
    dtype = jnp.dtype(args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16"))
    if args.layers is None:
        layer = args.in_features * args.out_features * dtype.itemsize
        args.layers = max(2, math.ceil(ROTATE_BYTES / layer))
    ceilings = measure_ceilings(1 << 20 if args.smoke else 1 << 30, 256 if args.smoke else 8192,
                                dtype, 3 if args.smoke else 10)
    dev = jax.devices()[0]
    print(f"{dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, {dtype}, "
          f"[{args.in_features} -> {args.out_features}] x {args.layers} layers; copy "
          f"{ceilings['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul "
          f"{ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    rows, failed = [], []
    for r in map(int, args.rows.split(",")):
        for layout in args.layouts.split(","):
            for name in args.formats.split(","):
                try:
                    rows.append(run(name, r, layout, args, dtype, ceilings))
                except jax.errors.JaxRuntimeError as e:  # e.g. blocks past the shared memory
                    failed.append({"format": name, "rows": r, "layout": layout,
                                   "error": str(e).splitlines()[0]})
                    print(f"FAILED: {name} {layout} rows={r}: {failed[-1]['error']}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": dev.device_kind, "platform": jax.default_backend(),
                       "host": platform.node(), "jax": jax.__version__, "dtype": str(dtype),
                       "shape": [args.in_features, args.out_features], "layers": args.layers,
                       **ceilings, "rows": rows, "failed": failed}, f, indent=1)
    # A wrong product fails the run: bfloat16 inputs round at ~4e-3; float32 sums far below.
    bad = [r for r in rows if not r["rel_err"] < (2e-2 if dtype.itemsize == 2 else 1e-4)]
    for r in bad:
        print(f"WRONG: {r['format']} rows={r['rows']} rel err {r['rel_err']:.1e}")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
