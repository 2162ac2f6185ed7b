"""The GPU bring-up kit: every check a session on a lent accelerator runs, in one call.

    python scripts/gpu_check.py --out DIR           # on the GPU machine (within 10 minutes)
    python scripts/gpu_check.py --smoke --out DIR   # the same steps on CPU, tiny shapes (CI)
    python scripts/gpu_check.py --out DIR --parity-model GGUF --parity-reference REF.json

Steps, each a subprocess with its own time limit and log in DIR (a step that fails or runs out
of time is reported and the next one runs; the most wanted run first, and those the deadline
leaves no time for are reported as skipped):

1. environment: python, jax/jaxlib/flax versions, devices and compute capability, the
   attention backend `auto` picks, nvidia-smi.
2. `python -m engine.bench --random-weights --config llama-3-8b --dtype bfloat16` at batch 1
   (one sequence's limits: a few executables), in bfloat16, `--quantization int8` and
   `int4` (XLA's autotuning off: its compile ran past the limit): TPOT beside its floor
   (weight + KV bytes a step over the same run's read bandwidth, a sum over a 4 GiB
   array), ready time from an empty compile cache, and the count of whole layer matrices
   the compiled step copies or converts (0: read in place);
   bf16's decode traced (`--profile`: the device's busy time a step, its events, the host's).
3. `python -m engine.bench.quantization`: float, int8 and int4 matmuls of the 8B MLP's shape at
   1 and 64 rows, each layer's weights sliced as a scan does, XLA's multiply and sum over
   packed int4, float, int8 and packed int4 weights through ops/pallas_gpu_matmul (int8 and
   int4 in two block shapes), and whether XLA copied or converted a whole matrix.
4. the 8B engine at batch 64 (the engine's default limits and layer loop), its decode traced.
5. online: `python -m server --load-format dummy` on the 8B shape (config.json and a
   word-level tokenizer, random weights) with step 4's limits, so its executables come from
   the store step 4 filled (its ready time is a warm start); a completion, a streamed one
   and /metrics; then `python -m engine.bench serve` at concurrency 1 and 64, beside the
   offline engine's TPOT (step 2) and tokens a second (step 4).
6. with --parity-model: `python -m models.parity` in bfloat16 against a saved transformers
   reference (`--save-reference`, made on a CPU machine), and a greedy chat through
   `python -m server` serving that model on the device, and the same model at one stream on
   tests/data/grounded_prompts.jsonl without and with speculative decoding by prompt lookup,
   paired in one process (`speculative`: the TPOT ratio and the acceptance); `--parity-model` and
   `--parity-reference` may be given again for more models (parity only, steps `parity_2`...).
7. the engine bench for the default model's shape (smollm2-135m) at batch 1: TPOT beside
   its matmuls alone (`dense_t1`), its decode traced; then again with the layer loop inside
   the step's command buffer (XLA_FLAGS `--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`).
8. the 8B engine at batch 64 with `--layer-loop scan` (the baseline of step 4).
9. kernel tests: the attention kernels over float16, bfloat16, fp8 and int8 KV pages, and
   tests/test_pallas_gpu_attention.py, compiled for the GPU (interpret mode and a subset
   under --smoke).
10. `python -m engine.bench.attention`: our kernels against the reference and JAX's bundled
   kernel, with the copy and matmul ceilings of the same run.
11. the default model's shape at batch 64.

Writes DIR/gpu_check.json (everything), DIR/gpu_check.md (the tables for
docs/performance-log.md, and each of the GPU checks with its figure and bound) and
DIR/bundle.tgz (every step's log and JSON and the traced steps' programs, under the 16 MiB a
file the device tool brings back: copy those three to $OUT). Exits non-zero
when a step failed. The steps are in scripts/gpu_check_steps.py, the report and the checks in
scripts/gpu_check_report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
from pathlib import Path

from gpu_check_report import checks, markdown
from gpu_check_steps import (
    ROOT,
    engine_bench,
    environment,
    online,
    parity,
    real_server,
    run_step,
    set_deadline,
    speculative,
)

# The steps import the checkout's packages (ops, models) and scripts/bench_servers.py.
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the logs and the report")
    ap.add_argument("--smoke", action="store_true",
                    help="the same steps on CPU with tiny shapes (CI); times mean nothing")
    ap.add_argument("--skip", default="", help="comma-separated step names to leave out")
    ap.add_argument("--deadline-s", type=float, default=560,
                    help="every step ends by then (the device tool stops a call at 600 s); "
                         "steps past it are reported as skipped")
    ap.add_argument("--parity-model", action="append", default=[],
                    help="a real model (GGUF file or HF directory) for the parity and "
                    "greedy-server steps; without it they are left out; again for more models "
                    "(parity only)")
    ap.add_argument("--parity-reference", action="append", default=[],
                    help="its transformers reference, saved with `python -m models.parity "
                    "--save-reference` (else transformers runs here); one per --parity-model, "
                    "in their order")
    args = ap.parse_args(argv)
    if len(args.parity_reference) > len(args.parity_model):
        ap.error("more --parity-reference than --parity-model")
    set_deadline(args.deadline_s)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # every step runs from the checkout (python -m server, tests/)
    skip = set(filter(None, args.skip.split(",")))
    smoke = args.smoke
    if smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    dtype = "float32" if smoke else "bfloat16"
    big = "tiny" if smoke else "llama-3-8b"
    label = big.replace("-", "_").replace(".", "_")
    batch = 8 if smoke else 64
    report = {"smoke": smoke, "environment": environment(), "steps": [], "big": label,
              "batch": batch}
    steps = report["steps"]
    py = sys.executable

    def wanted(name: str) -> bool:
        return name not in skip

    def profile(name: str) -> tuple[str, ...]:
        """engine.bench's --profile: 20 decode steps traced into DIR/NAME-trace."""
        return ("--profile", str(out / f"{name}-trace"))

    # Most wanted first (the deadline skips what is left).
    # int4 ran out of its 60 s on an H200 (2026-12-04) inside its measured requests.
    for q, limit in (("", 100), ("int8", 110), ("int4", 100)):
        name = f"engine_{label}_b1" + (f"_{q}" if q else "")
        # int4's first compile ran past 60 s on an H200 (2026-11-28): without XLA's autotuning
        # of its products, the suspect, so that a time at all comes back.
        env = ({"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                              + " --xla_gpu_autotune_level=0").strip()}
               if q == "int4" and not smoke else None)
        if wanted(name):  # bf16's step traced too: where a step's time goes
            steps.append(engine_bench(name, big, dtype, 1, out, 240 if smoke else limit, smoke,
                                      q or None, extra=() if q else profile(name), env=env))

    if wanted("quant_bench"):
        # The layer loop as the model runs it where XLA slices the stack (float: copied
        # before the product), and float, int8 and packed int4 weights through
        # ops/pallas_gpu_matmul (the stack and the layer index), int8 and int4 in two block
        # shapes. At one row `linear` runs float and per-channel int8 as a multiply and a
        # sum on a GPU, int4 in the Pallas kernel (`int4-reduce`: XLA's multiply and sum
        # over the same packed bytes, its rival).
        cmd = [py, "-m", "engine.bench.quantization", "--output", str(out / "quant_bench.json"),
               "--layouts", "stacked", "--rows", "1,64", "--formats",
               "float,int8,int4,int4-reduce,float-pallas,int8-pallas,int4-pallas,"
               "int8-pallas@64x512x0x8x3,int4-pallas@64x512x0x8x3"]
        steps.append(run_step("quant_bench", cmd + (["--smoke"] if smoke else []), out,
                              120 if smoke else 60))
        path = out / "quant_bench.json"
        if path.exists():
            report["quant_summary"] = json.loads(path.read_text())

    offline = {}
    if wanted(f"engine_{label}_b{batch}"):
        name = f"engine_{label}_b{batch}"  # traced too: where a batch's step goes
        offline = engine_bench(name, big, dtype, batch, out, 240 if smoke else 130, smoke,
                               extra=profile(name))
        steps.append(offline)
        path = out / f"engine_{label}_b{batch}.json"
        if path.exists() and "result" in offline:  # the limits and pages the server takes over
            offline["result"]["args"] = json.loads(path.read_text())["args"]
    if wanted("online"):
        steps.append(online(out, big, dtype, offline, 300 if smoke else 150, smoke))
    references = args.parity_reference + [None] * (len(args.parity_model)
                                                   - len(args.parity_reference))
    for i, (model, reference) in enumerate(zip(args.parity_model, references, strict=True)):
        if wanted("parity"):
            steps.append(parity(out, model, reference, dtype, 300 if smoke else 60,
                                name="parity" if i == 0 else f"parity_{i + 1}"))
        if i == 0 and wanted("real_server"):
            steps.append(real_server(out, model, dtype, 300 if smoke else 60, smoke))
        if i == 0 and wanted("speculative"):
            steps.append(speculative(out, model, dtype, 300 if smoke else 100, smoke))
    if not smoke and wanted("engine_smollm2_135m_b1"):
        steps.append(engine_bench("engine_smollm2_135m_b1", "smollm2-135m", dtype, 1, out, 50,
                                  smoke, extra=profile("engine_smollm2_135m_b1")))
    if not smoke and wanted("engine_smollm2_135m_b1_graphs"):
        # The same with the layer loop inside the step's command buffer (a CUDA graph with
        # conditional nodes), not one launch of its body an iteration from the host.
        flags = (os.environ.get("XLA_FLAGS", "")
                 + " --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL").strip()
        steps.append(engine_bench("engine_smollm2_135m_b1_graphs", "smollm2-135m", dtype, 1,
                                  out, 50, smoke, env={"XLA_FLAGS": flags}))
    # The baseline of batch 64: the plain scan, whose float products at a few rows XLA runs
    # on a copy of each layer's matrices (auto hands them to ops/pallas_gpu_matmul on a GPU).
    name = f"engine_{label}_b{batch}_scan"
    if wanted(name):
        steps.append(engine_bench(name, big, dtype, batch, out, 240 if smoke else 120, smoke,
                                  extra=("--layer-loop", "scan")))

    if wanted("kernel_tests"):
        # The KV dtypes first, then the kernel's own tests; each case compiles its own
        # Triton kernel (~3 s).
        cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
               "tests/test_kv_cache_dtype.py::test_attention_reads_pages_in_their_dtype",
               "tests/test_kv_cache_dtype.py::"
               "test_int8_pages_round_trip_through_writes_with_their_scales",
               "tests/test_pallas_gpu_attention.py"]
        env = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "XLASERVE_CPU_KERNELS": "none"}
        if smoke:  # the kit's own run of them: the default suite runs every case on CPU
            cmd += ["-k", "pallas-gpu or bad_inputs or lowers_to_triton"]
        else:
            env["JAX_PLATFORMS"] = "cuda,cpu"  # the TPU kernel's interpreter needs the CPU
        # 45 cases of ~3 s of Triton compile each ran out of 60 s on an H200 (2026-12-04)
        steps.append(run_step("kernel_tests", cmd, out, 300 if smoke else 180, env))

    if wanted("attention_bench"):
        cmd = [py, "-m", "engine.bench.attention", "--output", str(out / "attention_bench.json")]
        cmd += (["--smoke", "--impls", "pallas-gpu,bundled-gpu,reference"] if smoke else
                ["--batches", "1,64,256", "--contexts", "2048,8192", "--repeats", "10"])
        steps.append(run_step("attention_bench", cmd, out, 300 if smoke else 70))
        path = out / "attention_bench.json"
        if path.exists():
            rows = json.loads(path.read_text()).get("rows", [])
            report["attention_summary"] = [r for r in rows if r.get("seconds")]

    if not smoke and wanted("engine_smollm2_135m_b64"):
        steps.append(engine_bench("engine_smollm2_135m_b64", "smollm2-135m", dtype, 64, out, 60,
                                  smoke))

    report["checks"] = checks(report)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))
    bundle(out)
    print(markdown(report))
    return 0 if all(s["ok"] for s in steps) else 1


BUNDLE_BYTES = 15 << 20  # the device tool brings back files of at most 16 MiB


def bundle(out: Path) -> None:
    """DIR/bundle.tgz: the steps' logs, JSON and the decode steps' programs (`*.hlo.txt`, from
    engine.bench --profile), without the traces' raw files or the dummy model, in one file
    small enough to come back from the device machine (the programs are left out if not)."""
    def files(programs: bool):
        for path in sorted(out.rglob("*")):
            if (path.is_file() and "dummy-model" not in path.parts
                    and (path.suffix in (".log", ".json", ".md")
                         or (programs and path.name.endswith(".hlo.txt")))):
                yield path

    for programs in (True, False):
        with tarfile.open(out / "bundle.tgz", "w:gz") as tar:
            for path in files(programs):
                tar.add(path, arcname=str(path.relative_to(out)))
        if (out / "bundle.tgz").stat().st_size <= BUNDLE_BYTES:
            return


if __name__ == "__main__":
    sys.exit(main())
