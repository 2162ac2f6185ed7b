"""The paths that run where xlaserve's CPU kernels (ops/native) are off: XLA's dot for the
quantized matmuls and the reference attention. Most machines build the kernels, so the
default run turns them off (XLASERVE_CPU_KERNELS=none) in a child pytest that runs a
representative set of the engine and server tests on the default model, and checks there
that the kernels were off: in the child itself (this module, collected with the kernels
off) and in its live server (its weights held one value a byte, as XLA's dot reads them; the
reference attention in its log). The live server's greedy tokens with the kernels off equal
those with them on, or part at a near-tie only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import jax.numpy as jnp
from conftest import SERVER_KEY

from models.known_models import SERVED_NAME
from ops import native
from ops.attention import resolve_backend
from ops.cpu_linear import runs_native
from ops.quantization import scheme_format

ROOT = Path(__file__).resolve().parents[1]
TOKENS_FILE = "kernels_off_greedy.json"  # the child's greedy reply, in its --basetemp

# Tests of the live server and of an engine beside it: the default model end to end, the
# engine's greedy tokens against the server's, streaming, seeded sampling, prefix-cached
# history read by the attention, and the weight bytes the server holds (checked against the
# kernels being off in the child).
TESTS = [
    "tests/test_server_openai.py::test_metrics_report_the_kv_pool_and_weight_bytes",
    "tests/test_server_openai.py::test_completion_and_usage_match_the_tokenizer",
    "tests/test_server_openai.py::test_streamed_completion_equals_the_whole_one",
    "tests/test_server_openai.py::test_n_2_and_seed_reproducibility",
    "tests/test_server_openai.py::test_prefix_cache_hits_show_as_cached_tokens",
    "tests/test_server_openai.py::test_greedy_http_equals_engine_generate[def fibonacci(n):]",
    "tests/test_kernels_off.py::test_the_kernels_are_off",
]


def _greedy(url: str) -> dict:
    """The live server's greedy reply to a fixed prompt: token ids and each token's top 2."""
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   headers={"Authorization": f"Bearer {SERVER_KEY}"},
                   json={"model": SERVED_NAME, "prompt": "The capital of France is",
                         "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"ids": choice["token_ids"], "tokens": choice["logprobs"]["tokens"],
            "top": choice["logprobs"]["top_logprobs"]}


if os.environ.get("XLASERVE_CPU_KERNELS") == "none":
    # Collected with the kernels off: in the child below, or in a whole run with them off.

    def test_the_kernels_are_off(live_server, tmp_path_factory):
        assert not native.available("qmatmul") and not native.available("attention")
        assert native.reason("qmatmul") == "XLASERVE_CPU_KERNELS=none"
        # What a model asks before it takes a kernel: the reference attention, XLA's dot.
        assert resolve_backend("auto") == "reference"
        assert not runs_native(jnp.float32, {"wq": scheme_format("int4")}, sharded=False)
        greedy = json.dumps(_greedy(live_server))
        (tmp_path_factory.getbasetemp() / TOKENS_FILE).write_text(greedy)

else:

    def test_engine_and_server_tests_pass_with_the_kernels_off(live_server, tmp_path):
        basetemp, report = tmp_path / "child", tmp_path / "report.xml"
        env = {**os.environ, "XLASERVE_CPU_KERNELS": "none"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "-n", "0", f"--basetemp={basetemp}", f"--junitxml={report}", *TESTS],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
        suite = ET.parse(report).getroot().find("testsuite")
        assert int(suite.get("tests")) == len(TESTS) and int(suite.get("skipped")) == 0
        # The child's live server (conftest.py's live_server logs there) ran the reference,
        # and said that its quantized products ran without the kernel, and what is faster.
        log = (basetemp / "server0" / "server.log").read_text()
        assert ", reference attention," in log
        assert "without the CPU kernel" in log and "--quantization w8a8" in log

        off, on = json.loads((basetemp / TOKENS_FILE).read_text()), _greedy(live_server)
        assert len(off["ids"]) == len(on["ids"]) == 16
        # XLA sums in another order than the kernels: a near-tie may go the other way.
        for i, (a, b) in enumerate(zip(off["ids"], on["ids"], strict=True)):
            if a != b:
                (_, p1), (second, p2) = sorted(on["top"][i].items(), key=lambda kv: -kv[1])
                assert off["tokens"][i] == second and p1 - p2 < 1e-3, (
                    f"token {i}: {a} with the kernels off, {b} with them on "
                    f"(top 2 with them on: {on['top'][i]})")
                break
