"""python -m engine.bench: throughput and latency of the in-process engine (offline mode).

    python -m engine.bench --num-prompts 64 --input-len 128 --output-len 128 --ignore-eos
    python -m engine.bench --random-weights --config llama-3-8b --num-prompts 64 ...
    python -m engine.bench serve --base-url URL --model NAME ...  (an OpenAI-compatible server)

Metrics follow vLLM's benchmark: TTFT (request start -> first token), TPOT
((E2E - TTFT) / (output tokens - 1)), E2E latency, request and token throughput.
Each run also measures the machine's ceilings (matmul rate in the model's dtype,
device copy bandwidth) and reports the achieved fraction of the matmul ceiling:
dense FLOPs done per second (2 x non-embedding parameters per processed token, plus
the LM head per sampled token; attention FLOPs not counted) over the matmul rate.

`--dataset FILE` takes the prompts from a JSON-lines file of chat conversations (each line an
object with `messages`), rendered with the model's chat template, in place of random token
ids: `tests/data/grounded_prompts.jsonl` holds edits, rewrites and quoted summaries of a
given text, where speculative decoding by prompt lookup (`--speculative-config`) has tokens
to find; the run then reports the drafts' acceptance rate and mean accepted length, and with
`--paired` drafting's gain per request against the same engine without it, both in this
process (engine/bench/paired.py).

`--json-schema SCHEMA` constrains every reply to a JSON schema (structured output) and adds
the host time spent filling the grammar masks per step (`grammar_mask_ms_per_step`).

`--simulate-device-ms X` measures the host path alone: the real scheduler, batch building,
postprocessing and detokenizer (of the default model's tokenizer) run against a runner whose
step takes X ms of wall time without holding the GIL or a core (a sleep), as a fast
accelerator would. It reports `host_ms_per_step` (the engine thread's wall time per step
not spent waiting for the device), `device_idle_ms_per_step` and `device_busy_fraction`
(how much of the run the device was busy); with overlapped steps (the default) the host
work hides behind the device's.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import time
from pathlib import Path

import jax
import numpy as np

from engine.bench import paired
from engine.bench.ceilings import dense_seconds, measure_ceilings, read_bandwidth, weight_copies
from engine.bench.simulated import SimulatedRunner
from engine.bench.timings import latency_stats, run, summarize
from engine.config import (
    CPU_ACTIVATION_DTYPES,
    CPU_KERNELS,
    CPU_MATMUL_DTYPES,
    LAYER_LOOPS,
    EngineConfig,
)
from engine.device import size_kv
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from ops.attention import BACKENDS
from ops.kv_cache import KV_CACHE_DTYPES
from ops.quantization import CHOICES as QUANTIZATION_CHOICES


class _IdsOnly:
    """Tokenizer stand-in for random-weight models: token ids in, token ids out."""

    eos_token_ids: frozenset[int] = frozenset()
    special_token_ids: frozenset[int] = frozenset()


def build_engine(args, num_models: int = 1) -> LLMEngine:
    """The engine the flags describe; `num_models`: engines that share the KV budget."""
    common = dict(dtype=args.dtype, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype,
                  max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, attention_backend=args.attention_backend,
                  tensor_parallel_size=args.tensor_parallel_size,
                  async_scheduling=args.async_scheduling, batch_invariant=args.batch_invariant,
                  cpu_kernels=args.cpu_kernels, cpu_matmul_dtype=args.cpu_matmul_dtype,
                  cpu_activation_dtype=args.cpu_activation_dtype,
                  layer_loop=args.layer_loop, speculative=args.speculative_config)
    if args.random_weights:
        from models.loader import resolve_dtype
        from models.presets import preset_config
        from models.sharding import make_mesh
        from models.weights import random_model

        cfg = EngineConfig(model=f"random:{args.config}", **common)
        mesh = make_mesh(args.tensor_parallel_size) if args.tensor_parallel_size > 1 else None
        model = random_model(preset_config(args.config), resolve_dtype(args.dtype),
                             seed=args.seed, attention_backend=args.attention_backend,
                             mesh=mesh, quantization=args.quantization)
        return LLMEngine(cfg, runner=ModelRunner(cfg, model=model), tokenizer=_IdsOnly(),
                         detokenize=False)
    from models.known_models import model_arg

    cfg = EngineConfig(model=model_arg(args.model), **common)
    # The KV pool the server would give this model (its default budget, engine.device).
    cfg = size_kv(cfg, num_models=num_models)
    return LLMEngine(cfg, detokenize=False)


def simulate(args) -> dict:
    """The --simulate-device-ms run: the host path's cost per step and the device's share."""
    from models.known_models import model_arg
    from models.tokenizer import Tokenizer

    path = model_arg(args.model)
    tokenizer = Tokenizer.for_model(path)
    cfg = EngineConfig(model=path, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       block_size=args.block_size, async_scheduling=args.async_scheduling)
    runner = SimulatedRunner(cfg, args.simulate_device_ms, tokenizer.vocab_size,
                             tokenizer.special_token_ids | tokenizer.eos_token_ids)
    engine = LLMEngine(cfg, runner=runner, tokenizer=tokenizer, detokenize=True)
    requests = make_requests(args, tokenizer.vocab_size, tokenizer.special_token_ids)
    timings, duration = run(engine, requests, args.concurrency or args.num_prompts)
    done = list(timings.values())
    out_tokens = sum(t.output_len for t in done)
    return {"platform": "simulated", "host": platform.processor() or platform.machine(),
            "simulate_device_ms": args.simulate_device_ms, "completed": len(done),
            "duration_s": duration, "num_steps": runner.num_steps,
            "total_output_tokens": out_tokens, "output_throughput": out_tokens / duration,
            "host_ms_per_step": (duration - engine.wait_s) / runner.num_steps * 1e3,
            "device_idle_ms_per_step": (duration - runner.busy_s) / runner.num_steps * 1e3,
            "device_busy_fraction": runner.busy_s / duration,
            "async_scheduling": engine.async_scheduling,
            **latency_stats("tpot", [(t.end - t.first) / (t.output_len - 1) for t in done
                              if t.output_len > 1]),
            "num_preemptions": engine.scheduler.num_preemptions, "args": vars(args)}


def _print(res: dict, output: str | None) -> None:
    width = max(len(k) for k in res)
    for k, v in res.items():
        if k not in ("args", "profile"):
            print(f"{k:<{width}}  {v:,.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if output:
        with open(output, "w") as f:
            json.dump(res, f, indent=2)


def dataset_requests(args, engine: LLMEngine):
    """`--dataset`: each line's conversation rendered with the chat template, cycled to
    --num-prompts, `--output-len` tokens each."""
    from models.chat_template import ChatTemplate

    template = ChatTemplate.for_tokenizer(engine.tokenizer)
    lines = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line]
    rng = random.Random(args.seed)
    reqs = []
    for i in range(args.num_prompts):
        text = template.render(lines[i % len(lines)]["messages"], add_generation_prompt=True)
        reqs.append((engine.encode(text, add_special_tokens=False), SamplingParams(
            temperature=args.temperature, max_tokens=args.output_len,
            ignore_eos=args.ignore_eos, seed=rng.getrandbits(32))))
    return reqs


def make_requests(args, vocab: int, special: frozenset[int]):
    rng = random.Random(args.seed)
    lo_in = max(1, int(args.input_len * (1 - args.range_ratio)))
    lo_out = max(1, int(args.output_len * (1 - args.range_ratio)))
    usable = [t for t in range(min(vocab, 32000)) if t not in special]
    structured = None
    if args.json_schema:  # a file, or the schema itself
        text = (Path(args.json_schema).read_text() if Path(args.json_schema).is_file()
                else args.json_schema)
        structured = StructuredOutputsParams(json=json.loads(text))
    reqs = []
    for _ in range(args.num_prompts):
        n_in = rng.randint(lo_in, args.input_len)
        n_out = rng.randint(lo_out, args.output_len)
        prompt = [rng.choice(usable) for _ in range(n_in)]
        reqs.append((prompt, SamplingParams(temperature=args.temperature, max_tokens=n_out,
                                            ignore_eos=args.ignore_eos, seed=rng.getrandbits(32),
                                            structured_outputs=structured)))
    return reqs


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF file, HF directory or Orbax checkpoint, or a known "
                                   "model's name (default: the default model; with --task "
                                   "embed, all-minilm-l6-v2)")
    p.add_argument("--task", choices=("generate", "embed"), default="generate",
                   help="embed: texts a second of an embedding model (engine/bench/embed.py)")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--config", default="smollm2-135m", help="preset shape for --random-weights")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len]; 0 = fixed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=None, help="default: all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV pages' dtype, as the server's")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                   help="weight-only quantization as the server's (auto keeps a GGUF's blocks; "
                        "random weights stay float under auto)")
    defaults = EngineConfig(model="")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"default: the engine's ({defaults.max_model_len}), or input + output "
                        f"length if larger")
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=defaults.max_num_batched_tokens)
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--attention-backend", default=defaults.attention_backend, choices=BACKENDS)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap each step with the host work of the one before (default: on)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="rows computed alike in any batch (EngineConfig.batch_invariant)")
    p.add_argument("--cpu-kernels", choices=CPU_KERNELS, default="auto",
                   help="our CPU kernels' variant, or none (EngineConfig.cpu_kernels)")
    p.add_argument("--cpu-matmul-dtype", choices=CPU_MATMUL_DTYPES, default="float32",
                   help="the dtype products of more than 8 rows multiply in on a CPU "
                        "(EngineConfig.cpu_matmul_dtype)")
    p.add_argument("--cpu-activation-dtype", choices=CPU_ACTIVATION_DTYPES, default="float32",
                   help="x's precision in the CPU kernel's 4-bit products "
                        "(EngineConfig.cpu_activation_dtype)")
    p.add_argument("--layer-loop", choices=LAYER_LOOPS, default="auto",
                   help="auto, scan, unroll or scan-pallas (EngineConfig.layer_loop)")
    p.add_argument("--simulate-device-ms", type=float, default=None,
                   help="measure the host path alone against a simulated device whose step "
                        "takes this long (no model runs)")
    p.add_argument("--speculative-config", metavar="JSON", default=None,
                   help='speculative decoding, as the server\'s flag: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' or \'{"model": PATH_OR_NAME, '
                        '"num_speculative_tokens": 4}\'')
    p.add_argument("--paired", action="store_true",
                   help="with --speculative-config: also build the engine without it, in this "
                        "process, and run every request alone on both, alternating "
                        "(engine/bench/paired.py): drafting's gain per request")
    p.add_argument("--dataset", help="prompts from a JSON-lines file of conversations "
                                     "({'messages': [...]} a line), e.g. "
                                     "tests/data/grounded_prompts.jsonl")
    p.add_argument("--json-schema", help="constrain every reply to this JSON schema (a file or "
                   "the schema's text): the cost of structured output")
    p.add_argument("--output", help="write the results as JSON")
    p.add_argument("--profile", metavar="DIR",
                   help="after the run, trace 20 decode steps into DIR and report where a "
                        "step's time goes (engine/profiling.py)")
    args = p.parse_args(argv)
    # The runner's progress (compiling, loaded from the store, memory): a run cut off by a
    # time limit still says how far it got.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        force=True)  # jax's imports may have set a handler up already
    if args.max_model_len is None:
        args.max_model_len = max(defaults.max_model_len,
                                 -(-(args.input_len + args.output_len) // 16) * 16)
    if args.paired and (why := paired.refusal(args)):
        p.error(why)
    if args.simulate_device_ms is not None:
        _print(simulate(args), args.output)
        return 0
    if args.task == "embed":
        from engine.bench.embed import run_embed

        res = run_embed(args)
        _print(res, args.output)
        return 0 if res["compilations_after_warmup"] == 0 else 1

    # Read before the KV pool takes the device's memory: 4 GiB on an accelerator.
    read_bytes_per_s = read_bandwidth(256 << 20 if jax.default_backend() == "cpu" else 4 << 30)
    plain = paired.plain_engine(args, build_engine) if args.paired else None
    built = time.perf_counter()
    engine = build_engine(args, num_models=2 if args.paired else 1)
    start = time.perf_counter()
    engine.warmup()
    warmup_s = time.perf_counter() - start
    ready_s = time.perf_counter() - built  # weights made or loaded, KV pool, warmup
    cfg = engine.runner.model_config
    ceilings = measure_ceilings(engine.runner.dtype, args.max_num_seqs, cfg.hidden_size,
                                cfg.intermediate_size)
    special = getattr(engine.tokenizer, "special_token_ids", frozenset())
    requests = (dataset_requests(args, engine) if args.dataset
                else make_requests(args, cfg.vocab_size, special))
    dense_t1 = dense_seconds(engine.runner, num_tokens=1)
    if plain is not None:
        pairs, timings, duration = paired.compare(plain, engine, requests)
    else:
        timings, duration = run(engine, requests, args.concurrency or args.num_prompts)
    # Ceilings are peaks: measure again after the run and keep the better reading of each
    # (a single reading on a shared VM can land on a busy moment).
    again = measure_ceilings(engine.runner.dtype, args.max_num_seqs, cfg.hidden_size,
                             cfg.intermediate_size)
    for key in ("matmul_flops_per_s", "copy_bytes_per_s"):
        ceilings[key] = max(ceilings[key], again[key])
    res = {"device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
           "host": platform.processor() or platform.machine(), "jax": jax.__version__,
           "model": engine.config.model, "dtype": str(np.dtype(engine.runner.dtype)),
           "quantization": args.quantization,
           "kv_cache_dtype": engine.runner.kv_dtype.name,
           "ready_s": ready_s, "warmup_s": warmup_s,
           "num_executables": len(engine.config.buckets()),
           "num_blocks": engine.config.total_blocks, **ceilings,
           "read_bytes_per_s": read_bytes_per_s, "dense_t1_ms": dense_t1 * 1e3,
           "weight_copies": weight_copies(engine.runner),
           **summarize(engine, timings, duration, ceilings), "args": vars(args)}
    res["median_tpot_over_dense_t1"] = res["median_tpot_ms"] / res["dense_t1_ms"]
    if plain is not None:
        res["paired"] = pairs
    if args.profile:
        from engine.profiling import describe, profile_steps

        res["profile"] = profile_steps(engine, requests, args.concurrency or args.num_prompts,
                                       args.profile)
        res["profile"]["programs"] = write_programs(engine.runner, args.profile)
        print(describe(res["profile"]))
    _print(res, args.output)
    compiled = res["compilations_after_warmup"]
    if plain is not None:
        compiled += res["paired"]["plain_compilations_after_warmup"]
    return 0 if compiled == 0 else 1


def write_programs(runner, directory: str) -> list[str]:
    """Each compiled decode step's optimized program (its kernels, fusions and copies, to read
    beside the trace's events) as DIRECTORY/step-ROWS.hlo.txt; the files written."""
    written = []
    for bucket, executable in sorted(runner._executables.items(), key=str):
        if bucket[0] != "step":
            continue
        try:
            text = executable.as_text()
        except Exception:  # loaded from the store, or no text from this backend
            continue
        path = Path(directory) / ("-".join(map(str, bucket)) + ".hlo.txt")
        path.write_text(text)
        written.append(str(path))
    return written


if __name__ == "__main__":
    sys.exit(main())
