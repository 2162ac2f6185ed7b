"""Latency plots for `python -m engine.bench serve --plot`: histograms and CDFs in one PNG."""

from __future__ import annotations

import numpy as np


def latency_series(res: dict) -> dict[str, np.ndarray]:
    """Per-metric samples in ms from a bench_serve result, successful requests only."""
    ok = [i for i, e in enumerate(res["errors"]) if not e]
    ttft = np.array([res["ttfts"][i] for i in ok])
    e2el = np.array([res["e2els"][i] for i in ok])
    out = np.array([res["output_lens"][i] for i in ok])
    many = out > 1
    return {"TTFT": ttft * 1000,
            "TPOT": (e2el[many] - ttft[many]) / (out[many] - 1) * 1000,
            "ITL": np.array([g for i in ok for g in res["itls"][i]]) * 1000,
            "E2EL": e2el * 1000}


def plot_latencies(res: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = latency_series(res)
    fig, axes = plt.subplots(2, len(series), figsize=(4 * len(series), 6.5), squeeze=False)
    for col, (name, ms) in enumerate(series.items()):
        hist, cdf = axes[0][col], axes[1][col]
        hist.set_title(f"{name} (n={ms.size})")
        cdf.set_xlabel(f"{name} (ms)")
        if ms.size == 0:
            hist.text(0.5, 0.5, "no samples", ha="center", transform=hist.transAxes)
            continue
        hist.hist(ms, bins=min(50, max(5, ms.size // 4)))
        for q, style in ((50, "--"), (99, ":")):
            hist.axvline(np.percentile(ms, q), color="k", linestyle=style, label=f"p{q}")
        hist.legend(fontsize="small")
        xs = np.sort(ms)
        cdf.plot(xs, np.arange(1, xs.size + 1) / xs.size)
        cdf.set_ylim(0, 1)
        cdf.grid(alpha=0.3)
    axes[0][0].set_ylabel("requests / gaps")
    axes[1][0].set_ylabel("CDF")
    fig.suptitle(f"{res['label']}: {res['completed']} requests, "
                 f"{res['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
