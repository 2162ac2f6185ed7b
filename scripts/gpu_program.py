"""The engine's decode step compiled for an NVIDIA H200 (or H100) on this host, without a GPU,
and what the compiled step holds: its kernels a step and a layer, its loops, and how its
thunks fall into command buffers (CUDA graphs, launched by the host once each).

    pip install jax-cuda13-plugin==JAX_VERSION jax-cuda13-pjrt==JAX_VERSION  # in its own venv
    python scripts/gpu_program.py --seqs 1 --seqs 64 --out DIR

XLA compiles for a GPU from a description of it (`--target`, a GpuTargetConfig in text form;
an H200's is built in) through jax's CUDA plugin, whose compile needs no device. The model is
built as the engine builds it on a GPU (`--layer-loop auto`: the Pallas product; the Pallas
attention kernel; bfloat16), with random weights of a preset (`--config`; the default model's
shape by default: a layer's kernels are the same for a larger model of the family, only their
tiles differ). On a GPU a step's time below ~1,000 kernels is mostly their number (each ~1-2
µs however small; docs/performance-log.md, "The kit on an H200, traced"), so this counts
them where no GPU is lent. DIR gets each step's optimized program and XLA's dump (the thunk
sequence after its passes: which kernels share a command buffer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H200 = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
runtime_version { major: 13 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 12 }
device_description_str: "NVIDIA H200"
"""

_INSTRUCTION = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = .*?\b([a-z][\w\-]*)\(")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines} of an optimized program, and the entry's."""
    comps, entry, current = {}, "", None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            current, comps[m.group(2)] = m.group(2), []
            entry = m.group(2) if m.group(1) else entry
        elif current and line.startswith("  "):
            comps[current].append(line.strip())
    return comps, entry


def kernels(comps: dict, name: str, trips: int = 1, loops: list | None = None) -> int:
    """The kernels one run of computation `name` launches (fusions, custom calls, copies...),
    a loop's body counted its known trip count of times and its condition once more than
    that; `loops` gets (trip count, kernels of one pass of the body) for each loop met."""
    total = 0
    for ins in comps[name]:
        m = _INSTRUCTION.match(ins)
        if not m or m.group(2) in _FREE:
            continue
        if m.group(2) == "while":
            body = re.search(r"body=%?([\w.\-]+)", ins).group(1)
            n = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins)
            n = int(n.group(1)) if n else 1
            one = kernels(comps, body, 1, loops)
            cond = kernels(comps, re.search(r"condition=%?([\w.\-]+)", ins).group(1))
            if loops is not None:
                loops.append({"trip_count": n, "kernels_a_pass": one,
                              "known": "known_trip_count" in ins})
            total += n * one + (n + 1) * cond
        else:
            total += 1
    return total * trips


def thunk_summary(dump: Path) -> dict:
    """Of XLA's thunk sequence after its passes: the thunks of each kind at the top level
    (each launched by the host) and inside loops and command buffers."""
    files = sorted(dump.glob("*jit__step*thunk_sequence_after_thunk_passes.txt"))
    if not files:
        return {}
    top, nested = {}, {}
    for line in files[-1].read_text().splitlines():
        m = re.match(r"^( *)\d+: (k\w+)", line)
        if m:
            where = top if not m.group(1) else nested
            where[m.group(2)] = where.get(m.group(2), 0) + 1
    return {"top_level": top, "nested": nested}


def compile_step(config: str, seqs: int, layer_loop: str, target: str, out: Path,
                 num_layers: int | None = None, quantization: str | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies

    gpu = topologies.get_topology_desc("gpu", "cuda", target_config=target,
                                       topology="1x1x1").devices[0]
    from engine.batch import empty_batch
    from engine.config import EngineConfig
    from engine.grammar import mask_words
    from engine.model_runner import ModelRunner
    from models.presets import preset_config
    from models.weights import random_model

    cfg = EngineConfig(model=f"random:{config}", dtype="bfloat16", max_model_len=2048,
                       max_num_seqs=seqs, max_num_batched_tokens=max(128, seqs),
                       attention_backend="pallas-gpu", cpu_kernels="none",
                       layer_loop=layer_loop, num_blocks=128 * seqs + 8)
    shape = preset_config(config)
    if num_layers:  # a large model's layers and head without all of its weights in memory
        shape = dataclasses.replace(shape, num_layers=num_layers)
    model = random_model(shape, jnp.bfloat16, attention_backend="pallas-gpu",
                         quantization=quantization)
    runner = ModelRunner(cfg, model=model)
    on_gpu = jax.sharding.SingleDeviceSharding(gpu)
    abstract = lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=on_gpu)  # noqa: E731
    counts, mask, last = runner.slot_state
    batch = empty_batch(cfg, (seqs, seqs))
    host = (batch.body, batch.sampling_ints, batch.sampling_floats,
            np.zeros((seqs, mask_words(runner.model_config.vocab_size)), np.int32))
    args = jax.tree.map(abstract, (runner.params, runner.kv, counts, mask, last, *host))
    hlo = jax.jit(runner._step, donate_argnums=(1, 2, 4)).lower(*args).compile().as_text()
    (out / f"step-{seqs}.hlo.txt").write_text(hlo)
    comps, entry = computations(hlo)
    loops: list = []
    total = kernels(comps, entry, loops=loops)
    layers = runner.model_config.num_layers
    layer_loop_found = next((lp for lp in loops if lp["trip_count"] == layers), None)
    return {"config": config, "seqs": seqs, "layer_loop": layer_loop, "quantization": quantization,
            "stacked_kernel": model.stacked_kernel, "kernels_a_step": total,
            "kernels_a_layer": layer_loop_found and layer_loop_found["kernels_a_pass"],
            "loops": loops}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2-135m", help="preset shape (random weights)")
    ap.add_argument("--seqs", type=int, action="append", help="decode rows (again for more)")
    ap.add_argument("--layer-loop", default="auto")
    ap.add_argument("--num-layers", type=int, help="fewer layers than the preset's (a layer's "
                    "kernels and the head's are the same; the step's total is not)")
    ap.add_argument("--quantization", help="int8 or int4: the weights quantized as "
                    "`--quantization` makes them")
    ap.add_argument("--target", help="a GpuTargetConfig in text form (default: an H200)")
    ap.add_argument("--out", required=True, help="directory for the programs and XLA's dump")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: this many rows
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    target = Path(args.target).read_text() if args.target else H200
    if args.one is not None:  # the model as the engine builds it on a GPU (see the docstring)
        import jax

        jax.default_backend = lambda: "gpu"
        res = compile_step(args.config, args.one, args.layer_loop, target, out,
                           args.num_layers, args.quantization)
        print("RESULT " + json.dumps(res))
        return 0
    results = []
    for seqs in args.seqs or [1]:
        dump = out / f"dump-{seqs}"
        dump.mkdir(parents=True, exist_ok=True)
        # A process a size: XLA reads its flags once, and the dump goes where they say.
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLASERVE_CPU_KERNELS="none",
                   XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"))
        cmd = [sys.executable, __file__, "--one", str(seqs), "--config", args.config,
               "--layer-loop", args.layer_loop, "--out", str(out)]
        if args.num_layers:
            cmd += ["--num-layers", str(args.num_layers)]
        if args.target:
            cmd += ["--target", args.target]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        res = json.loads(line.removeprefix("RESULT "))
        res["thunks"] = thunk_summary(dump)
        results.append(res)
        print(f"{args.config}, {seqs} rows: {res['kernels_a_step']} kernels a step, "
              f"{res['kernels_a_layer']} a layer; loops (trip count x kernels a pass): "
              + ", ".join(f"{lp['trip_count']} x {lp['kernels_a_pass']}" for lp in res["loops"])
              + f"; top-level thunks {res['thunks'].get('top_level')}")
    (out / "gpu_program.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
