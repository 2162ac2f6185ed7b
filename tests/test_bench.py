"""`python -m engine.bench` smoke test on a tiny random-weight model (no timing asserted)."""

import json
from pathlib import Path

import pytest

from engine.bench import offline as bench


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


def test_simulated_device_measures_the_host_path(tmp_path, default_gguf):
    """--simulate-device-ms: the real scheduler, batch and detokenizer against a device that
    sleeps; one prefill step (8 x 32 prompt tokens fit the 512-token budget) then 7 decode
    steps, each at least 5 ms of device time."""
    out = tmp_path / "sim.json"
    rc = bench.main(["--model", str(default_gguf), "--simulate-device-ms", "5",
                     "--num-prompts", "8", "--input-len", "32", "--output-len", "8",
                     "--ignore-eos", "--output", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["completed"] == 8 and res["total_output_tokens"] == 64
    assert res["num_steps"] == 8
    assert 0 < res["device_busy_fraction"] < 1 and res["host_ms_per_step"] > 0
    assert res["device_busy_fraction"] * res["duration_s"] >= 8 * 0.005


def test_profile_traces_decode_steps_and_reads_the_trace_back(tmp_path):
    """--profile: 20 decode steps traced after the run and summarized from the trace file (on
    CPU the runtime's events are on the host; no device plane)."""
    out = tmp_path / "bench.json"
    rc = bench.main(["--random-weights", "--config", "tiny", "--num-prompts", "2",
                     "--input-len", "8", "--output-len", "30", "--ignore-eos",
                     "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--concurrency", "1",
                     "--profile", str(tmp_path / "trace"), "--output", str(out)])
    prof = json.loads(out.read_text())["profile"]
    assert rc == 0 and prof["steps"] == 20 and prof["wall_ms_per_step"] > 0
    assert (tmp_path / "trace").is_dir() and prof["trace"].endswith(".xplane.pb")
    assert prof["device_busy_ms_per_step"] is None and prof["top_host"]
    assert all(row["ms_per_step"] > 0 and row["per_step"] > 0 for row in prof["top_host"])
    # the decode steps' optimized programs beside the trace, to read its events against
    assert prof["programs"] and all(
        Path(p).parent == tmp_path / "trace" and "HloModule" in Path(p).read_text()
        for p in prof["programs"])



def test_paired_runs_every_request_alone_on_both_engines_in_turn(tmp_path, monkeypatch):
    """--paired: each request alone on the engine without drafting and on the one with it,
    the first of the two alternating, and drafting's gain per request in `paired`."""
    from engine.bench import paired as paired_module

    calls = []
    real_run = paired_module.run

    def run(engine, requests, concurrency):
        calls.append((engine.config.speculative is not None, len(requests), concurrency))
        return real_run(engine, requests, concurrency)

    monkeypatch.setattr(paired_module, "run", run)
    out = tmp_path / "paired.json"
    rc = bench.main(["--random-weights", "--config", "tiny", "--num-prompts", "4",
                     "--input-len", "24", "--output-len", "6", "--ignore-eos",
                     "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                     "--paired", "--output", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["completed"] == 4 and res["total_output_tokens"] == 24
    assert calls == [(False, 1, 1), (True, 1, 1), (True, 1, 1), (False, 1, 1)] * 2
    paired = res["paired"]
    assert paired["requests"] == 4 and paired["plain_compilations_after_warmup"] == 0
    assert paired["median_tpot_ratio"] > 0 and paired["mean_tpot_ratio"] > 0


def test_paired_needs_a_speculative_config_and_one_request_at_a_time():
    with pytest.raises(SystemExit):
        bench.main(["--random-weights", "--config", "tiny", "--paired"])
    with pytest.raises(SystemExit):
        bench.main(["--random-weights", "--config", "tiny", "--paired", "--concurrency", "4",
                    "--speculative-config", '{"method": "ngram"}'])
