"""Two processes serve one model together (jax.distributed on CPU, gloo collectives, loopback
coordinator): process 0 has 2 CPU devices and serves HTTP, process 1 has 1 and follows, so
the default model (9 heads, 3 KV heads) runs at tensor parallel 3 across both. Greedy
output equals one process's; killing the follower fails the in-flight request with an
error and turns /health to 503 without taking process 0 down."""

from __future__ import annotations

import json

import httpx
from servers import free_port, running_server, server_command, spawn, stop

PROMPT_TEXTS = ["The capital of France is", "def fibonacci(n):"]
MODEL = "SmolLM2-135M-Instruct"


def _devices(n: int) -> dict:  # not the 8 fake devices of the in-process tests
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}


def test_two_processes_serve_one_model(default_gguf, tokenizer, default_decoder, tmp_path):
    prompts = [tokenizer.encode(p) for p in PROMPT_TEXTS]
    single_process = [default_decoder.generate(p, 16)[0] for p in prompts]
    coordinator = f"127.0.0.1:{free_port(consecutive=2)}"  # PORT and the step channel PORT+1
    # One request at a time: each process compiles one sequence's executables (a multi-process
    # run has no executable store) and nothing more.
    common = ["--model", str(default_gguf), "--dtype", "float32", "--max-model-len", "256",
              "--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--num-pages", "64",
              "--coordinator-address", coordinator, "--num-processes", "2"]
    follower = spawn(server_command(*common, "--process-id", "1"), tmp_path / "follower.log",
                     _devices(1))
    try:
        with running_server([*common, "--process-id", "0"], tmp_path / "leader.log",
                            _devices(2)) as url:
            for prompt, want in zip(prompts, single_process, strict=True):
                r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == want

            # A long stream is in flight when the follower is killed.
            events = []
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    "model": MODEL, "prompt": prompts[0], "max_tokens": 200,
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
