"""Two processes serve one model together (jax.distributed on CPU, gloo collectives, loopback
coordinator): one CPU device each, process 0 serving HTTP and process 1 following, a tiny
random model split over both (tensor parallel 2). Greedy output equals one process's;
killing the follower fails the in-flight request with an error and turns /health to 503
without taking process 0 down."""

from __future__ import annotations

import json

import httpx
import pytest
from servers import free_port, running_server, server_command, spawn, stop
from tiny_models import save_tiny_hf

from models.generate import GreedyDecoder
from models.loader import load_model

PROMPTS = [[5, 17, 3, 99, 42, 7, 150, 23], [200, 11, 77, 31, 2, 9, 120, 64, 33, 180, 1, 4]]
MODEL = "tiny"


# One CPU device per process (not the 8 fake ones the in-process tests use).
ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("tiny"), num_key_value_heads=2)


def test_two_processes_serve_one_model(tiny, tmp_path):
    decoder = GreedyDecoder(load_model(tiny, dtype="float32"), max_len=256)
    single_process = [decoder.generate(p, 16)[0] for p in PROMPTS]
    assert len(set(single_process[0])) > 1, "degenerate model"
    coordinator = f"127.0.0.1:{free_port(consecutive=2)}"  # PORT and the step channel PORT+1
    common = ["--model", f"{MODEL}={tiny}", "--dtype", "float32", "--max-model-len", "256",
              "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--num-pages", "64",
              "--coordinator-address", coordinator, "--num-processes", "2"]
    follower = spawn(server_command(*common, "--process-id", "1"), tmp_path / "follower.log",
                     ONE_DEVICE)
    try:
        with running_server([*common, "--process-id", "0"], tmp_path / "leader.log",
                            ONE_DEVICE) as url:
            for prompt, want in zip(PROMPTS, single_process, strict=True):
                r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == want

            # A long stream is in flight when the follower is killed.
            events = []
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200,
                    "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line.removeprefix("data: "))
                    if len(events) == 2:
                        follower.kill()
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert "Gloo" in error["message"] or "cluster lost" in error["message"], error
            assert sum("choices" in e for e in events) < 200  # it did not finish

            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 503
            r = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 503
            assert "multi-host cluster lost (follower 1" in r.json()["error"]["message"]
            assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200  # still up
    finally:
        stop(follower)
