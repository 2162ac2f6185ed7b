"""scripts/bench_servers.py's report: each run's summary (the figures kept in summary.json,
and the count of replies of the wrong length) and the markdown tables it prints."""

from __future__ import annotations


def _completed_lengths(run: dict):
    """(asked for, got) of each completed request."""
    return [(want, got) for want, got, err in zip(run["requested_output_lens"],
                                                 run["output_lens"], run["errors"], strict=True)
            if not err]


def wrong_lengths(run: dict) -> int:
    """Completed requests whose output length is not the one asked for."""
    return sum(1 for want, got in _completed_lengths(run) if got != want)


def cut_replies(run: dict) -> int:
    """Completed requests cut at the longest asked for (`--natural-length`)."""
    return sum(1 for want, got in _completed_lengths(run) if got == want)


GENERATE_KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                 "p99_tpot_ms", "median_itl_ms", "median_e2el_ms", "total_output_tokens")
EMBED_KEYS = ("request_throughput", "total_token_throughput", "mean_e2el_ms",
              "median_e2el_ms", "p99_e2el_ms", "embedding_dims")


def run_summary(run: dict, args) -> dict:
    keys = EMBED_KEYS if args.task == "embed" else GENERATE_KEYS
    out = {k: run[k] for k in ("label", "completed", "failed", "duration_s",
                               "total_input_tokens", *keys, "host", "cpu_count")}
    if args.task == "embed":
        return out
    return out | {"wrong_length": (cut_replies if args.natural_length else wrong_lengths)(run)}


def print_runs(runs: list[dict], args) -> None:
    if args.task == "embed":
        print("\n| server | concurrency | texts/s | prompt tok/s | mean ms | median ms | p99 ms "
              "| failed |\n|---|---|---|---|---|---|---|---|")
        for r in runs:
            name, c = r["label"].rsplit(" c=", 1)
            print(f"| {name} | {c} | {r['request_throughput']:.1f} | "
                  f"{r['total_token_throughput']:.0f} | {r['mean_e2el_ms']:.1f} | "
                  f"{r['median_e2el_ms']:.1f} | {r['p99_e2el_ms']:.1f} | {r['failed']} |")
        return
    lengths = (f"cut at {args.output_len} tokens" if args.natural_length
               else f"not {args.output_len} tokens")
    print("\n| server | concurrency | output tok/s | output tokens | median TTFT ms | "
          f"median TPOT ms | failed | {lengths} |\n|---|---|---|---|---|---|---|---|")
    for r in runs:
        name, c = r["label"].rsplit(" c=", 1)
        print(f"| {name} | {c} | {r['output_throughput']:.1f} | {r['total_output_tokens']} | "
              f"{r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | {r['failed']} | "
              f"{r['wrong_length']} |")
