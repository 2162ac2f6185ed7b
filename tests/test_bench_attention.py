"""`python -m engine.bench.attention --smoke`: every implementation runs on tiny shapes in
interpret mode and agrees with the reference (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from engine.bench import attention as bench_attention


@pytest.mark.slow  # over a minute: every kernel interpreted (each has tests of its own)
def test_smoke_runs_every_implementation(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_attention.main(["--smoke", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert not [r for r in rows if "error" in r]
    impls = {r["impl"] for r in rows}
    assert impls == {"pallas-gpu", "pallas-tpu", "bundled-gpu", "reference"}
    decode = [r for r in rows if r["case"].startswith("decode")]
    mixed = [r for r in rows if r["case"].startswith("mixed")]
    assert {r["impl"] for r in mixed} == impls - {"bundled-gpu"}  # it only decodes
    assert len(decode) == 4 * 4 and len(mixed) == 2 * 3
    assert all(r["rel_err"] < 2e-2 and r["seconds"] > 0 for r in rows)
    assert result["ceilings"]["copy_bytes_per_s"] > 0
    assert "summary" in capsys.readouterr().out
