"""`python -m engine.bench` smoke test on a tiny random-weight model (no timing asserted)."""

import json

from engine import bench


def test_bench_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench.main(["--random-weights", "--config", "tiny", "--num-prompts", "6",
                     "--input-len", "12", "--output-len", "5", "--range-ratio", "0.5",
                     "--ignore-eos", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                     "--concurrency", "3", "--output", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["completed"] == 6
    assert res["compilations_after_warmup"] == 0
    for key in ("output_throughput", "median_ttft_ms", "median_tpot_ms", "ceiling_fraction",
                "matmul_flops_per_s", "copy_bytes_per_s", "p99_e2el_ms"):
        assert res[key] > 0, key
    assert 2 * 6 <= res["total_output_tokens"] <= 5 * 6  # lengths drawn from [2, 5]
