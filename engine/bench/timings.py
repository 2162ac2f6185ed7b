"""Requests through an in-process engine, timed as vLLM's benchmark times them, and a run's
summary (the metrics engine/bench/offline.py's docstring defines); `python -m engine.bench`
and its `--paired` mode (engine/bench/paired.py) share them.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from engine.llm_engine import LLMEngine
from models.registry import param_specs


@dataclasses.dataclass
class RequestTiming:
    start: float
    prompt_len: int
    first: float | None = None
    end: float | None = None
    output_len: int = 0


def run(engine: LLMEngine, requests, concurrency: int) -> tuple[dict[str, RequestTiming], float]:
    """`requests` ((prompt ids, params) pairs) through `engine`, at most `concurrency` at a
    time; each request's timing, and the seconds the run took."""
    pending = list(requests)
    timings: dict[str, RequestTiming] = {}
    in_flight = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            prompt, params = pending.pop(0)
            rid = engine.add_request(prompt, params)
            timings[rid] = RequestTiming(time.perf_counter(), len(prompt))
            in_flight += 1
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:  # (deltas: each holds the tokens new since the last)
            t = timings[out.request_id]
            t.output_len += len(out.outputs[0].token_ids)
            if t.first is None and t.output_len:
                t.first = now
            if out.finished:
                t.end = now
                in_flight -= 1
    return timings, time.perf_counter() - start


def latency_stats(name: str, values_s: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values_s) or [float("nan")]
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(engine: LLMEngine, timings, duration: float, ceilings: dict) -> dict:
    done = list(timings.values())
    out_tokens = sum(t.output_len for t in done)
    in_tokens = sum(t.prompt_len for t in done)
    cfg = engine.runner.model_config
    # The model's weights as float parameters (a quantized matrix's scales are not FLOPs).
    n_params = sum(int(np.prod(spec.shape)) for spec in param_specs(cfg).values())
    embed = cfg.vocab_size * cfg.hidden_size
    dense = n_params - embed - (0 if cfg.tie_word_embeddings else embed)
    flops = 2 * dense * (in_tokens + out_tokens) + 2 * embed * out_tokens
    achieved = flops / duration
    res = {
        "completed": len(done), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **latency_stats("ttft", [t.first - t.start for t in done]),
        **latency_stats("tpot", [(t.end - t.first) / (t.output_len - 1) for t in done
                          if t.output_len > 1]),
        **latency_stats("e2el", [t.end - t.start for t in done]),
        "achieved_dense_flops_per_s": achieved,
        "ceiling_fraction": achieved / ceilings["matmul_flops_per_s"],
        "compilations_after_warmup": engine.runner.compilations_after_warmup,
        "async_scheduling": engine.async_scheduling,
        "num_preemptions": engine.scheduler.num_preemptions,
    }
    if engine.config.speculative is not None:
        spec = engine.scheduler.drafting.stats
        res.update(spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                   spec_acceptance_rate=spec.acceptance_rate,
                   spec_mean_accepted_length=spec.mean_accepted_length)
        if engine.draft is not None:  # a draft model: its rounds and what one took
            round_s = engine.scheduler.drafting.step_costs.draft_round
            res.update(spec_draft_rounds=engine.draft.num_rounds,
                       spec_draft_round_ms=None if round_s is None else 1e3 * round_s)
    if engine.grammars.mask_steps:  # host time filling grammar masks (beside the body)
        res["grammar_mask_steps"] = engine.grammars.mask_steps
        res["grammar_mask_ms_per_step"] = (1e3 * engine.grammars.mask_seconds
                                           / engine.grammars.mask_steps)
    return res
