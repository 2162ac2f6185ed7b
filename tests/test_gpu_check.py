"""The GPU bring-up kit runs end to end: `scripts/gpu_check.py --smoke` (the same steps on CPU
with tiny shapes) passes every step and writes its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ops import native

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [s["name"] for s in report["steps"]]
    assert names == ["engine_tiny_b1", "engine_tiny_b1_int8", "quant_bench", "engine_tiny_b8",
                     "kernel_tests", "server", "attention_bench"]
    assert all(s["ok"] for s in report["steps"])
    on_cpu = "cpu" if native.available() else "reference"  # our kernel where it was built
    assert report["environment"]["auto_attention_backend"] == on_cpu
    b1 = next(s for s in report["steps"] if s["name"] == "engine_tiny_b1")["result"]
    assert b1["compilations_after_warmup"] == 0 and b1["hbm_fraction"] > 0
    int8 = next(s for s in report["steps"] if s["name"] == "engine_tiny_b1_int8")["result"]
    assert int8["compilations_after_warmup"] == 0
    assert 0 < int8["floor_tpot_ms"] < b1["floor_tpot_ms"]  # a byte a weight, not float32's 4
    assert report["attention_summary"] and all(r["rel_err"] < 1e-2
                                                for r in report["attention_summary"])
    quant = report["quant_summary"]["rows"]
    assert {r["format"] for r in quant} == {"float", "int8", "int4"}
    assert {r["layout"] for r in quant} == {"stacked", "counted", "unrolled"}
    assert all(r["rel_err"] < 1e-4 and r["seconds"] > 0 for r in quant)
    assert "| int4 | counted | 4 |" in (tmp_path / "gpu_check.md").read_text()
    server = next(s for s in report["steps"] if s["name"] == "server")
    assert server["completion_tokens"] == 8 and server["stream_chunks"] >= 8
    assert "| engine_tiny_b8 |" in (tmp_path / "gpu_check.md").read_text()
