"""`python -m engine.bench --speculative-config JSON --paired`: what drafting gains at one
stream, measured so that the machine's drift cannot pass for it.

The 2-vCPU VMs this engine is measured on change speed by a third within an hour, so two
runs in turn (one without drafting, then one with it) compare two moments of the machine as
much as two engines. Here the same flags build two engines in one process, one without
`--speculative-config` and one with it, each with half the KV budget, and every request runs
alone on both, back to back, the order swapped from one request to the next. Each request's
time per output token without drafting over its time with it is one ratio; the run reports
the median of those ratios and the ratio of the mean times (`paired` in the JSON).
"""

from __future__ import annotations

import argparse
import statistics

from engine.bench.timings import run
from engine.llm_engine import LLMEngine


def refusal(args: argparse.Namespace) -> str | None:
    """Why the bench's flags cannot run `--paired`, or None."""
    if not args.speculative_config:
        return "--paired compares an engine with --speculative-config to one without it"
    if args.concurrency not in (None, 1):
        return "--paired runs each request alone (--concurrency 1)"
    return None


def plain_engine(args: argparse.Namespace, build_engine) -> LLMEngine:
    """The engine of the bench's flags without --speculative-config, warmed up, with half the
    KV budget (`build_engine(args, num_models)`: the other half is the drafting engine's)."""
    plain = build_engine(argparse.Namespace(**{**vars(args), "speculative_config": None}),
                         num_models=2)
    plain.warmup()
    return plain


def _tpot(timings) -> float | None:
    (t,) = timings.values()
    return (t.end - t.first) / (t.output_len - 1) if t.output_len > 1 else None


def compare(plain: LLMEngine, drafting: LLMEngine, requests) -> tuple[dict, dict, float]:
    """Each request alone on `plain` and on `drafting`, the first of the two alternating.
    Returns the paired summary, and `drafting`'s timings and busy seconds (for `summarize`)."""
    plain_s, drafting_s, ratios = [], [], []
    timings, duration = {}, 0.0
    for i, request in enumerate(requests):
        measured = {}
        for engine in (plain, drafting) if i % 2 == 0 else (drafting, plain):
            measured[engine is drafting] = run(engine, [request], 1)
        (on, on_s), (off, _) = measured[True], measured[False]
        timings.update(on)
        duration += on_s
        with_drafts, without = _tpot(on), _tpot(off)
        if with_drafts and without:  # both gave at least two tokens
            plain_s.append(without)
            drafting_s.append(with_drafts)
            ratios.append(without / with_drafts)
    if not ratios:
        raise ValueError("--paired: no request gave two tokens or more to time")
    summary = {
        "requests": len(ratios),
        "plain_median_tpot_ms": 1e3 * statistics.median(plain_s),
        "drafting_median_tpot_ms": 1e3 * statistics.median(drafting_s),
        "median_tpot_ratio": statistics.median(ratios),
        "mean_tpot_ratio": statistics.fmean(plain_s) / statistics.fmean(drafting_s),
        "plain_compilations_after_warmup": plain.runner.compilations_after_warmup,
    }
    return summary, timings, duration
