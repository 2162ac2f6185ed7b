"""The GPU bring-up kit runs end to end: `scripts/gpu_check.py --smoke` (the same steps on CPU
with tiny shapes) passes every step and writes its report. The default run takes the kit's
report and its time limits; its steps run under `-m slow` (what a GPU session rehearses
first): the engine and server steps (the kit's engine and server, rehearsed alone) and every
step, whose measurements repeat tests of their own (tests/test_bench.py,
tests/test_bench_serve.py, tests/test_bench_attention.py, tests/test_pallas_gpu_attention.py,
tests/test_quantization.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ops import native

ROOT = Path(__file__).resolve().parents[1]
# Left out of the default run (each has tests of its own); every step runs under -m slow.
OTHERWISE_TESTED = ("engine_tiny_b1_int8", "engine_tiny_b1_int4", "quant_bench", "kernel_tests",
                    "attention_bench", "engine_tiny_b8_scan")


def smoke(out: Path, skip: tuple[str, ...] = ()) -> dict:
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(out),
                           "--skip", ",".join(skip)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_gpu_check_smoke_engine_and_server_steps(tmp_path):
    report = smoke(tmp_path, OTHERWISE_TESTED)
    assert [s["name"] for s in report["steps"]] == ["engine_tiny_b1", "engine_tiny_b8", "online"]
    assert all(s["ok"] for s in report["steps"])
    b1 = report["steps"][0]["result"]
    assert b1["compilations_after_warmup"] == 0 and b1["hbm_fraction"] > 0
    assert b1["read_bytes_per_s"] > 0 and b1["floor_tpot_ms"] > 0 and b1["ready_s"] > 0
    assert set(b1["weight_copies"]) == {"step1", "tokens1"}  # the one-row steps were read
    assert b1["profile"]["steps"] > 0 and b1["profile"]["top_host"]  # 20 steps traced
    server = report["steps"][2]
    assert server["completion_tokens"] == 8 and server["stream_chunks"] >= 8
    # The server took the batch-8 run's limits and pages, so its executables came from the
    # store that run filled; then engine.bench serve at concurrency 1 and 4.
    assert "--num-pages" in server["cmd"] and "--load-format" in server["cmd"]
    assert server["c1"]["completed"] == 4 and server["c4"]["completed"] == 16
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| engine_tiny_b8 |" in text and "| online c=1 TPOT ms |" in text
    assert "engine_tiny_b1, traced:" in text
    with tarfile.open(tmp_path / "bundle.tgz") as tar:  # what comes back from the device
        names = tar.getnames()
    assert {"gpu_check.json", "engine_tiny_b1.log", "engine_tiny_b8.json"} <= set(names)
    assert any(n.startswith("engine_tiny_b8-trace/step-") and n.endswith(".hlo.txt")
               for n in names)
    assert not any(n.endswith(".pb") or "dummy-model" in n for n in names)


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path):
    report = smoke(tmp_path)
    names = [s["name"] for s in report["steps"]]
    assert names == ["engine_tiny_b1", "engine_tiny_b1_int8", "engine_tiny_b1_int4",
                     "quant_bench", "engine_tiny_b8", "online", "engine_tiny_b8_scan",
                     "kernel_tests", "attention_bench"]
    assert all(s["ok"] for s in report["steps"])
    # our kernel where it was built
    on_cpu = "cpu" if native.available("attention") else "reference"
    assert report["environment"]["auto_attention_backend"] == on_cpu
    b1 = next(s for s in report["steps"] if s["name"] == "engine_tiny_b1")["result"]
    assert b1["compilations_after_warmup"] == 0 and b1["hbm_fraction"] > 0
    int8 = next(s for s in report["steps"] if s["name"] == "engine_tiny_b1_int8")["result"]
    assert int8["compilations_after_warmup"] == 0
    assert 0 < int8["floor_tpot_ms"] < b1["floor_tpot_ms"]  # a byte a weight, not float32's 4
    int4 = next(s for s in report["steps"] if s["name"] == "engine_tiny_b1_int4")["result"]
    assert int4["step_bytes"] < int8["step_bytes"]
    assert report["attention_summary"] and all(r["rel_err"] < 1e-2
                                                for r in report["attention_summary"])
    quant = report["quant_summary"]["rows"]
    assert {r["format"] for r in quant} == {"float", "int8", "int4", "float-pallas",
                                            "int8-pallas", "float-pallas@32x512x0x4x3",
                                            "int8-pallas@64x512x0x4x3"}
    assert {r["layout"] for r in quant} == {"stacked", "unrolled"}
    assert all(r["rel_err"] < 1e-4 and r["seconds"] > 0 for r in quant)
    assert "| float-pallas | stacked | 4 |" in (tmp_path / "gpu_check.md").read_text()
    scan = next(s for s in report["steps"] if s["name"] == "engine_tiny_b8_scan")["result"]
    assert scan["compilations_after_warmup"] == 0
    server = next(s for s in report["steps"] if s["name"] == "online")
    assert server["completion_tokens"] == 8 and server["stream_chunks"] >= 8
    assert "| engine_tiny_b8 |" in (tmp_path / "gpu_check.md").read_text()


def test_a_step_past_its_limit_leaves_its_stack_in_the_log(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check_steps
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.setattr(gpu_check_steps, "MIN_STEP_SECONDS", 0)
    hang = "import threading; threading.Event().wait()"
    step = gpu_check_steps.run_step("hang", [sys.executable, "-c", hang], tmp_path, timeout=5)
    log = (tmp_path / "hang.log").read_text()
    assert step["rc"] == "timeout" and not step["ok"]
    assert "Fatal Python error: Aborted" in log and 'File "<string>", line 1' in log


def test_the_report_covers_every_parity_model(capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
        import gpu_check_report
    finally:
        sys.path.remove(str(ROOT / "scripts"))

    def parity(name, model, agreement):
        return {"name": name, "ok": agreement >= 0.98, "seconds": 1.0, "rc": 0,
                "cmd": ["python", "-m", "models.parity", "--model", model],
                "result": {"agreement": agreement, "dtype": "bfloat16", "backend": "gpu",
                           "positions": 320, "prompts": 10, "pallas_products": True}}

    report = {"environment": {"devices": [{"kind": "H100"}]}, "smoke": False, "big": "x",
              "batch": 64, "steps": [parity("parity", "/tmp/SmolLM2.gguf", 0.99),
                                     parity("parity_2", "/tmp/gemma-3-270m.gguf", 0.97)]}
    text = gpu_check_report.markdown(report)
    assert "Parity of SmolLM2.gguf" in text and "Parity of gemma-3-270m.gguf" in text
    got = {what: passed for what, _, _, passed in gpu_check_report.checks(report)}
    assert got["parity: top-1 agreement"] and not got["parity_2: top-1 agreement"]
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", "x", "--parity-reference", "a.json"])
    assert "more --parity-reference than --parity-model" in capsys.readouterr().err


@pytest.mark.slow
def test_the_speculative_step_on_a_real_model(tmp_path, default_gguf):
    """The kit's `speculative` step (with --parity-model) on the CPU: the paired bench runs,
    and the report holds the ratio and the drafts' acceptance."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check_report
        import gpu_check_steps
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    step = gpu_check_steps.speculative(tmp_path, str(default_gguf), "float32", 600, smoke=True)
    assert step["ok"], step
    assert step["result"]["speedup"] > 0 and step["result"]["tpot_plain_ms"] > 0
    assert step["result"]["requests"] == 2 and step["result"]["spec_acceptance_rate"] > 0
    assert step["result"]["compilations_after_warmup"] == [0, 0]
    assert step["result"]["profile"]["steps"] > 0  # the drafting engine's steps, traced
    report = {"steps": [step], "big": "llama_3_8b", "batch": 64, "smoke": True}
    assert "speculative decoding (ngram), one stream: TPOT plain / drafting" in {
        what for what, *_ in gpu_check_report.checks(report)}
    assert "The drafting engine (prompt lookup, one stream), traced:" in (
        gpu_check_report.markdown({**report, "environment": {}}))
