"""The printed tables of `python -m engine.bench serve` (vLLM's `vllm bench serve` layout):
a generation run's (`print_table`) and the rows an embedding run shares with it
(engine/bench/serve_embed.py)."""

from __future__ import annotations


def row(name: str, value, fmt: str = "") -> None:
    """A line of the printed tables (vLLM's benchmark's layout)."""
    print(f"{name:<40} {value:<10{fmt}}")


def section(title: str, fill: str = "-") -> None:
    print("{s:{c}^{n}}".format(s=title, n=50, c=fill))


def print_head(res: dict, title: str) -> None:
    """A result table's title and the rows every run has."""
    section(f" {title} ", "=")
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if res["max_concurrency"] is not None:
        row("Maximum request concurrency:", res["max_concurrency"])
    row("Request rate (req/s):", res["request_rate"], ".2f")
    row("Benchmark duration (s):", res["duration_s"], ".2f")
    row("Total input tokens:", res["total_input_tokens"])


def print_latency(res: dict, key: str, name: str, header: str) -> None:
    section(header)
    for stat, title in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
        row(f"{title} {name} (ms):", res[f"{stat}_{key}_ms"], ".2f")


def print_tail(res: dict) -> None:
    """The machine's ceilings, when measured, and the table's end."""
    if "matmul_flops_per_s" in res:
        section("Machine ceilings (this host)")
        row("Matmul rate (TFLOP/s):", res["matmul_flops_per_s"] / 1e12, ".3f")
        row("Copy bandwidth (GB/s):", res["copy_bytes_per_s"] / 1e9, ".2f")
    print("=" * 50)


def print_table(res: dict) -> None:
    print_head(res, "Serving Benchmark Result")
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", res["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", res["total_token_throughput"], ".2f")
    for key, name, header in (("ttft", "TTFT", "Time to First Token"),
                              ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                              ("itl", "ITL", "Inter-token Latency"),
                              ("e2el", "E2EL", "End-to-end Latency")):
        print_latency(res, key, name, header)
    if "spec_num_drafts" in res:
        section("Speculative Decoding")
        row("Acceptance rate (%):", 100 * res["spec_acceptance_rate"], ".2f")
        row("Acceptance length:", res["spec_mean_accepted_length"], ".2f")
        row("Drafts:", res["spec_num_drafts"])
        row("Draft tokens:", res["spec_num_draft_tokens"])
    print_tail(res)
