"""The report of scripts/gpu_check.py: the tables for docs/performance-log.md (`markdown`) and the
GPU checks, each with its figure and bound (`checks`), from the steps' results."""

from __future__ import annotations

from pathlib import Path


def markdown(report: dict) -> str:
    env = report["environment"]
    dev = env.get("devices", [{}])[0]
    lines = [f"# GPU check ({'smoke, CPU' if report['smoke'] else dev.get('kind')})", "",
             f"jax {env.get('jax')} (jaxlib {env.get('jaxlib')}), flax {env.get('flax')}, "
             f"python {env.get('python')}; backend {env.get('backend')}, compute capability "
             f"{dev.get('compute_capability')}; `auto` attention: "
             f"{env.get('auto_attention_backend')}.", ""]
    if env.get("nvidia_smi"):
        lines += [f"nvidia-smi: {env['nvidia_smi']}", ""]
    lines += ["| step | ok | seconds |", "|---|---|---|"]
    for s in report["steps"]:
        ok = "yes" if s["ok"] else f"NO ({s.get('rc', s.get('error'))})"
        lines.append(f"| {s['name']} | {ok} | {s.get('seconds', 0):.0f} |")
    benches = [s for s in report["steps"] if "result" in s and "median_tpot_ms" in s["result"]]
    if benches:
        lines += ["", "| engine.bench | TPOT ms | floor ms (b=1: bytes / read) | out tok/s | "
                  "TTFT ms | dense_t1 ms | dense/ceiling | read fraction (b=1) | "
                  "matmul TFLOP/s | read GB/s | copy GB/s | weight copies | ready s | "
                  "warmup s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in benches:
            r = s["result"]
            def f(k, scale=1.0, fmt="{:.1f}", r=r):
                return "" if r.get(k) is None else fmt.format(r[k] * scale)

            copies = r.get("weight_copies")
            copies = "" if copies is None else sum(copies.values())
            lines.append(f"| {s['name']} | {f('median_tpot_ms', fmt='{:.2f}')} | "
                         f"{f('floor_tpot_ms', fmt='{:.2f}')} | {f('output_throughput')} | "
                         f"{f('median_ttft_ms')} | {f('dense_t1_ms', fmt='{:.2f}')} | "
                         f"{f('ceiling_fraction', fmt='{:.3f}')} | "
                         f"{f('hbm_fraction', fmt='{:.2f}')} | "
                         f"{f('matmul_flops_per_s', 1e-12, '{:.1f}')} | "
                         f"{f('read_bytes_per_s', 1e-9, '{:.0f}')} | "
                         f"{f('copy_bytes_per_s', 1e-9, '{:.0f}')} | {copies} | "
                         f"{f('ready_s')} | {f('warmup_s')} |")
    titles = {"speculative": "The drafting engine (prompt lookup, one stream)"}
    for s in report["steps"]:  # engine.bench --profile: where a decode step's time goes
        prof = (s.get("result") or {}).get("profile")
        if prof:
            from engine.profiling import describe  # the checkout's: on sys.path by then

            lines += ["", f"{titles.get(s['name'], s['name'])}, traced:", "", "```",
                      describe(prof), "```"]
    net = next((s for s in report["steps"] if s["name"] == "online"), None)
    if net:
        lines += ["", f"Online (`python -m server --load-format dummy`, ready in "
                  f"{net.get('ready_s', float('nan')):.1f} s; `engine.bench serve`):", "",
                  "| concurrency | TPOT ms | TTFT ms | out tok/s | completed |",
                  "|---|---|---|---|---|"]
        for key in sorted(k for k in net if k[0] == "c" and k[1:].isdigit()):
            r = net[key]
            lines.append(f"| {key[1:]} | {r['median_tpot_ms']:.2f} | {r['median_ttft_ms']:.1f} | "
                         f"{r['output_throughput']:.1f} | {r['completed']} |")
        if net.get("profile"):
            from engine.profiling import describe

            r = net["profiled"]
            lines += ["", f"The server traced at {r['completed']} streams (TPOT "
                      f"{r['median_tpot_ms']:.2f} ms while tracing):", "", "```",
                      describe(net["profile"]), "```"]
    for par in (s for s in report["steps"] if _is_parity(s["name"]) and s.get("result")):
        r = par["result"]
        lines += ["", f"Parity of {Path(par['cmd'][par['cmd'].index('--model') + 1]).name} "
                  f"({r.get('dtype')} on {r.get('backend')}, Pallas products: "
                  f"{r.get('pallas_products')}): top-1 agreement {r['agreement']:.4f} over "
                  f"{r.get('positions')} positions of {r.get('prompts')} prompts."]
    real = next((s for s in report["steps"] if s["name"] == "real_server"), None)
    if real and real.get("answer") is not None:
        lines += ["", f"Greedy chat through the server (ready in {real['ready_s']:.1f} s): "
                  f"{real['answer']!r}"]
    if report.get("checks"):
        lines += ["", "| check | figure | bound | passed |", "|---|---|---|---|"]
        lines += [f"| {what} | {figure:.4g} | {bound} | {'yes' if ok else 'NO'} |"
                  for what, figure, bound, ok in report["checks"]]
    quant = report.get("quant_summary")
    if quant:
        lines += ["", f"engine.bench.quantization: [{quant['shape'][0]} -> {quant['shape'][1]}] x "
                  f"{quant['layers']} layers, {quant['dtype']}; copy "
                  f"{quant['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul "
                  f"{quant['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s", "",
                  "| format | layout | rows | ms / layer | weight MiB | copy fraction | "
                  "matmul fraction | rel err | materialized |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['format']} | {r['layout']} | {r['rows']} | {r['seconds'] * 1e3:.4f} | "
                  f"{r['weight_bytes'] / 2**20:.1f} | {r['copy_fraction']:.2f} | "
                  f"{r['matmul_fraction']:.3f} | {r['rel_err']:.1e} | {r['materialized']} |"
                  for r in quant["rows"]]
    attn = report.get("attention_summary")
    if attn:
        lines += ["", "engine.bench.attention (see attention_bench.log for every row):", "",
                  "| case | impl | time | copy fraction | ours x | rel err |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['impl']} | {r['seconds'] * 1e3:.3f} ms | "
                  f"{r.get('copy_fraction', 0):.2f} | {r.get('ours_speedup', 0):.2f} | "
                  f"{r.get('rel_err', 0):.1e} |" for r in attn]
    return "\n".join(lines) + "\n"


def checks(report: dict) -> list[tuple[str, float | None, str, bool | None]]:
    """The GPU checks: (what, figure, bound, passed), from this run."""
    steps = {s["name"]: s for s in report["steps"]}
    result = lambda name: steps.get(name, {}).get("result") or {}
    big = report["big"]
    bf16, int8, int4 = (result(f"engine_{big}_b1{q}") for q in ("", "_int8", "_int4"))
    b64 = result(f"engine_{big}_b{report['batch']}")
    b64_scan = result(f"engine_{big}_b{report['batch']}_scan")
    small = result("engine_smollm2_135m_b1")
    small_graphs = result("engine_smollm2_135m_b1_graphs")
    net = steps.get("online", {})
    rows = []

    def check(what, figure, bound, ok):
        rows.append((what, figure, bound, None if figure is None else bool(ok)))

    tpot = bf16.get("median_tpot_ms")
    if tpot and bf16.get("floor_tpot_ms"):
        check("b=1 bf16 TPOT ms", tpot, f"<= 1.15 x floor {bf16['floor_tpot_ms']:.2f}",
              tpot <= 1.15 * bf16["floor_tpot_ms"])
    for name, res, share in (("int8", int8, 0.6), ("int4", int4, 0.4)):
        if tpot and res.get("median_tpot_ms"):
            check(f"b=1 {name} TPOT ms", res["median_tpot_ms"], f"<= {share} x bf16's",
                  res["median_tpot_ms"] <= share * tpot)
    for name, res in (("bf16", bf16), ("int8", int8), ("int4", int4), ("b=64", b64),
                      ("b=64 --layer-loop scan", b64_scan)):
        if res.get("weight_copies") is not None:
            copies = sum(res["weight_copies"].values())
            check(f"{name}: whole weight matrices copied in the step", copies, "== 0",
                  copies == 0)
    for name, res in (("b=64", b64), ("b=64 --layer-loop scan", b64_scan)):
        if res.get("output_throughput"):
            check(f"{name} output tok/s", res["output_throughput"], ">= 2.5 x 2,762 (H200)",
                  res["output_throughput"] >= 2.5 * 2762)
    if tpot and (net.get("c1") or {}).get("median_tpot_ms"):
        online_tpot = net["c1"]["median_tpot_ms"]
        check("online c=1 TPOT ms", online_tpot, f"within 10% of offline {tpot:.2f}",
              online_tpot <= 1.1 * tpot)
    c64 = net.get(f"c{4 if report['smoke'] else 64}") or {}
    if b64.get("output_throughput") and c64.get("output_throughput"):
        check("online c=64 output tok/s", c64["output_throughput"],
              f"within 10% of offline {b64['output_throughput']:.0f}",
              c64["output_throughput"] >= 0.9 * b64["output_throughput"])
    for name, res in (("135M b=1", small), ("135M b=1, loop in the command buffer",
                                             small_graphs)):
        if res.get("median_tpot_ms") and res.get("dense_t1_ms"):
            check(f"{name} TPOT ms", res["median_tpot_ms"],
                  f"<= 1.5 x dense_t1 {res['dense_t1_ms']:.2f}",
                  res["median_tpot_ms"] <= 1.5 * res["dense_t1_ms"])
    if b64.get("ready_s"):
        check("ready, cold compile cache (b=64 table), s", b64["ready_s"], "<= 60",
              b64["ready_s"] <= 60)
    if net.get("ready_s"):
        check("server ready, warm (from the store), s", net["ready_s"], "<= 15",
              net["ready_s"] <= 15)
    spec = steps.get("speculative", {}).get("result") or {}
    if spec.get("speedup"):
        check("speculative decoding (ngram), one stream: TPOT plain / drafting", spec["speedup"],
              ">= 1.5", spec["speedup"] >= 1.5)
    for name, step in steps.items():
        agreement = (step.get("result") or {}).get("agreement") if _is_parity(name) else None
        if agreement is not None:
            check(f"{name}: top-1 agreement", agreement, ">= 0.98", agreement >= 0.98)
    return rows


def _is_parity(name: str) -> bool:
    return name == "parity" or name.startswith("parity_")
