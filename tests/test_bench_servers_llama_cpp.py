"""scripts/bench_servers.py: which servers run, llama-server's command line, readiness and
memory of a started process, and the count of requests with the wrong output length."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.modules["bench_servers_report"] = report = load_script("bench_servers_report")
bench_servers = load_script("bench_servers")


def test_servers_default_to_xlaserve_and_those_given_a_path():
    assert bench_servers.parse_args([]).servers == ["xlaserve"]
    args = bench_servers.parse_args(["--llama-cpp-server", "/bin/llama-server"])
    assert args.servers == ["xlaserve", "llama-cpp-server"]
    args = bench_servers.parse_args(["--llama-cpp-server", "/x", "--servers", "llama-cpp-server"])
    assert args.servers == ["llama-cpp-server"]


@pytest.mark.parametrize("argv", [["--servers", "llama-cpp-server"], ["--servers", "vllm"]])
def test_servers_without_a_path_or_unknown_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit):
        bench_servers.parse_args(argv)
    assert "--servers" in capsys.readouterr().err


def test_llama_server_gets_one_slot_per_concurrent_request_each_at_least_as_long():
    args = bench_servers.parse_args(["--llama-cpp-server", "/bin/llama-server",
                                     "--llama-threads", "2", "--input-len", "100",
                                     "--output-len", "50"])
    cmd, ready = bench_servers.server_command("llama-cpp-server", args, "/m.gguf", 1234)
    flag = lambda name: cmd[cmd.index(name) + 1]
    assert cmd[0] == "/bin/llama-server" and ready == "/health"
    assert flag("-m") == "/m.gguf" and flag("--port") == "1234" and flag("-t") == "2"
    assert flag("--alias") == bench_servers.SERVED_NAME
    # llama.cpp rounds each slot's context up to a multiple of 256; each holds a whole request
    assert flag("-np") == "64" and flag("-c") == str(64 * 256)
    assert int(flag("-c")) // 64 >= 100 + 50
    # xlaserve runs with its default flags, as a new user would
    ours, _ = bench_servers.server_command("xlaserve", args, "/m.gguf", 1)
    assert ours[1:] == ["-m", "server", "--port", "1"]


def test_speculative_runs_each_server_again_with_prompt_lookup():
    args = bench_servers.parse_args(["--llama-cpp-server", "/bin/llama-server", "--speculative",
                                     "--dataset", "tests/data/grounded_prompts.jsonl"])
    assert args.servers == ["xlaserve", "xlaserve+spec", "llama-cpp-server",
                            "llama-cpp-server+spec"]
    ours, _ = bench_servers.server_command("xlaserve+spec", args, "/m.gguf", 1)
    assert ours[1:] == ["-m", "server", "--port", "1", "--speculative-config",
                        '{"method":"ngram","num_speculative_tokens":4}']
    plain, _ = bench_servers.server_command("llama-cpp-server", args, "/m.gguf", 1)
    theirs, _ = bench_servers.server_command("llama-cpp-server+spec", args, "/m.gguf", 1)
    assert theirs == [*plain, "--spec-type", "ngram-simple"]
    assert int(plain[plain.index("-c") + 1]) // 64 >= 1024 + 128  # a conversation and its reply
    with pytest.raises(SystemExit):
        bench_servers.parse_args(["--speculative", "--task", "embed"])
    with pytest.raises(SystemExit):  # a draft model is for --speculative runs
        bench_servers.parse_args(["--draft-model", "qwen2.5-coder-0.5b"])


def test_a_draft_model_drafts_for_both_servers(monkeypatch):
    monkeypatch.setattr(bench_servers, "fetch_model", lambda name: f"/cache/{name}.gguf")
    args = bench_servers.parse_args(["--llama-cpp-server", "/bin/llama-server", "--speculative",
                                     "--model", "qwen2.5-coder-1.5b",
                                     "--draft-model", "qwen2.5-coder-0.5b"])
    assert bench_servers.model_file(args) == "/cache/qwen2.5-coder-1.5b.gguf"
    assert bench_servers.served_model(args) == "Qwen2.5-Coder-1.5B-Instruct"
    ours, _ = bench_servers.server_command("xlaserve+spec", args, "/m.gguf", 1)
    assert ours[1:] == ["-m", "server", "--model", "qwen2.5-coder-1.5b", "--port", "1",
                        "--speculative-config",
                        '{"model": "/cache/qwen2.5-coder-0.5b.gguf", "num_speculative_tokens": 4}']
    theirs, _ = bench_servers.server_command("llama-cpp-server+spec", args, "/m.gguf", 1)
    assert theirs[-6:] == ["--spec-type", "draft-simple", "-md", "/cache/qwen2.5-coder-0.5b.gguf",
                           "--spec-draft-n-max", "4"]


def test_wrong_lengths_counts_completed_requests_only():
    run = {"requested_output_lens": [8, 8, 8, 8], "output_lens": [8, 7, 0, 9],
           "errors": ["", "", "HTTP 500", ""]}
    assert report.wrong_lengths(run) == 2
    assert report.cut_replies(run) == 1  # cut at the longest asked for


def test_natural_length_lets_replies_end_and_needs_a_dataset(monkeypatch, tmp_path, capsys):
    sent = []
    monkeypatch.setattr(bench_servers.subprocess, "run", lambda cmd: sent.append(cmd))
    (tmp_path / "x-c1.json").write_text("{}")
    for natural in ([], ["--natural-length"]):
        args = bench_servers.parse_args(["--dataset", "d.jsonl", "--output-len", "1024",
                                         *natural])
        bench_servers.bench("http://h", "x", 1, args, tmp_path)
    assert "--ignore-eos" in sent[0] and "--ignore-eos" not in sent[1]
    assert sent[1][sent[1].index("--output-len") + 1] == "1024"  # the cap
    with pytest.raises(SystemExit):
        bench_servers.parse_args(["--natural-length"])
    assert "--natural-length is for --dataset" in capsys.readouterr().err


def test_running_reports_ready_time_and_memory_and_stops_the_server(tmp_path):
    port = bench_servers.free_port()
    serve = [sys.executable, "-c",
             "import http.server, time; time.sleep(1); "
             f"http.server.test(http.server.SimpleHTTPRequestHandler, port={port}, "
             "bind='127.0.0.1')"]
    with bench_servers.running(serve, f"http://127.0.0.1:{port}", "/", tmp_path / "log",
                               timeout=60) as started:
        assert 1 <= started["ready_after_s"] < 60
        assert 1 < started["rss_mib"] < 1000  # a Python interpreter
    with pytest.raises(httpx.TransportError):  # stopped
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2)


def test_running_fails_fast_when_the_server_exits(tmp_path):
    with pytest.raises(RuntimeError, match="exited with 3"):
        with bench_servers.running([sys.executable, "-c", "raise SystemExit(3)"],
                                   "http://127.0.0.1:9", "/", tmp_path / "log", timeout=60):
            pass


def test_llama_server_keeps_q4_1_weights_out_of_ggml_amx_buffers_on_amx_cpus():
    # The vendored llama.cpp segfaults in its AMX matmul on such a CPU (2026-11-24).
    assert bench_servers.llama_cpp_workarounds("flags : avx2 amx_bf16 amx_int8 amx_tile") \
        == ["--no-repack"]
    assert bench_servers.llama_cpp_workarounds("flags : avx2 avx512f fma") == []


def test_embed_runs_xlaserve_and_llama_server_embedding_at_1_and_64():
    args = bench_servers.parse_args(["--task", "embed", "--llama-cpp-server", "/bin/llama-server",
                                     "--llama-threads", "2"])
    assert args.servers == ["xlaserve", "llama-cpp-server"]
    assert args.concurrency == [1, 64] and args.num_prompts == 256
    cmd, ready = bench_servers.server_command("llama-cpp-server", args, "/m.f32.gguf", 1234)
    flag = lambda name: cmd[cmd.index(name) + 1]
    assert ready == "/health" and flag("-m") == "/m.f32.gguf"
    assert "--embedding" in cmd and flag("--pooling") == "mean"
    assert flag("--alias") == "all-MiniLM-L6-v2"
    # one slot per concurrent request, each holding a 128-word text and its [CLS], [SEP]
    assert flag("-np") == "64" and int(flag("-c")) // 64 >= 128 + 2
    ours, _ = bench_servers.server_command("xlaserve", args, "", 1)
    assert ours[1:] == ["-m", "server", "--model", "all-minilm-l6-v2", "--port", "1"]
    generate = bench_servers.parse_args([])
    assert generate.concurrency == [1, 8, 64] and generate.num_prompts == 64
    assert "--embedding" not in bench_servers.server_command(
        "llama-cpp-server", bench_servers.parse_args(["--llama-cpp-server", "/x"]), "/m", 1)[0]


def test_embed_does_not_measure_llama_cpp_python(capsys):
    with pytest.raises(SystemExit):
        bench_servers.parse_args(["--task", "embed", "--llama-cpp-python", "/bin/python"])
    assert "llama-cpp-python" in capsys.readouterr().err


def test_the_converter_comes_from_the_tree_the_server_was_built_from(tmp_path):
    server = tmp_path / "build-0.3.36" / "bin" / "llama-server"
    source = bench_servers.llama_cpp_source(str(server))
    assert source == tmp_path / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    cmd = bench_servers.convert_command(source, Path("/models/m"), Path("/out.gguf"))
    assert cmd[1] == str(source / "convert_hf_to_gguf.py") and cmd[2] == "/models/m"
    assert cmd[cmd.index("--outtype") + 1] == "f32"  # float32, as xlaserve computes
    assert cmd[cmd.index("--outfile") + 1] == "/out.gguf"


def test_the_embedding_model_is_converted_once(tmp_path, monkeypatch):
    source = tmp_path / "llama.cpp"
    source.mkdir()
    (source / "convert_hf_to_gguf.py").write_text("")
    calls = []

    def convert(cmd, check):
        calls.append(cmd)
        Path(cmd[cmd.index("--outfile") + 1]).write_bytes(b"GGUF")

    monkeypatch.setattr(bench_servers, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(bench_servers.subprocess, "run", convert)
    first = bench_servers.embedding_gguf(tmp_path / "all-MiniLM-L6-v2", source)
    again = bench_servers.embedding_gguf(tmp_path / "all-MiniLM-L6-v2", source)
    assert first == again == tmp_path / "all-MiniLM-L6-v2.f32.gguf"
    assert first.read_bytes() == b"GGUF" and len(calls) == 1
    first.unlink()
    with pytest.raises(SystemExit, match="--llama-cpp-source"):  # no converter there
        bench_servers.embedding_gguf(tmp_path / "all-MiniLM-L6-v2", tmp_path / "nowhere")


def test_embed_table_reports_texts_and_tokens_a_second(capsys):
    args = bench_servers.parse_args(["--task", "embed"])
    run = {"label": "xlaserve c=64", "completed": 256, "failed": 0, "duration_s": 4.0,
           "total_input_tokens": 256 * 130, "request_throughput": 64.0,
           "total_token_throughput": 64.0 * 130, "mean_e2el_ms": 900.0,
           "median_e2el_ms": 880.0, "p99_e2el_ms": 1500.0, "embedding_dims": [384],
           "host": "x86_64", "cpu_count": 2, "output_lens": []}
    summary = report.run_summary(run, args)
    assert "output_lens" not in summary and "wrong_length" not in summary
    report.print_runs([summary], args)
    assert "| xlaserve | 64 | 64.0 | 8320 | 900.0 | 880.0 | 1500.0 | 0 |" in capsys.readouterr().out
