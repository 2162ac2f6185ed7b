"""Shared fixtures. The default model is fetched once into the user cache."""

from __future__ import annotations

import os

# Tests run on the CPU in float32 unless a test says otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight fake CPU devices for the tensor-parallel tests; everything else uses the first.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

# Under xdist every worker has a core of its own: torch's OpenMP threads (the transformers
# references) would otherwise spin on the other workers' cores (the parity test took twice
# as long beside another module).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

# The modules that take minutes, in the order they start: workers take whole files in
# collection order, so the long ones go first and the short ones fill in after them (one
# worker would otherwise run the longest alone at the end).
LONG_MODULES = ("test_tensor_parallel.py", "test_engine.py", "test_kv_cache_dtype.py",
                "test_default_model.py", "test_batch_invariance.py", "test_model_families.py",
                "test_kernels_off.py", "test_multihost.py", "test_server_gemma3.py",
                "test_pallas_tpu_attention.py", "test_pallas_gpu_attention.py",
                "test_cpu_attention.py", "test_fuzz_api.py", "test_security_streams.py",
                "test_server_structured.py", "test_attention_backends.py",
                "test_tool_loop.py", "test_logit_bias.py", "test_server_responses.py",
                "test_decoder_embeddings.py", "test_bert.py")


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker a core, at most 4 (each holds compiled engines and the
    transformers reference: a few GiB)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file


@pytest.fixture(scope="session")
def default_gguf():
    from models.known_models import fetch_default_model

    return fetch_default_model(quiet=True)


@pytest.fixture(scope="session")
def gemma3_gguf():
    """Gemma 3 270M (base model, Q4_K_M GGUF; Gemma terms), fetched like the default model."""
    from models.known_models import fetch_model

    return fetch_model("gemma3-270m", quiet=True)


@pytest.fixture(scope="session")
def tokenizer(default_gguf):
    """The default model's tokenizer (fake engines and HTTP tests use it too)."""
    from models.tokenizer import Tokenizer

    return Tokenizer.from_path(default_gguf)


@pytest.fixture(scope="session")
def default_decoder(default_gguf):
    """One device's greedy decoding of the default model (float32 weights, the reference
    attention): what the multi-host and tensor-parallel runs must equal. Shared, so its
    steps compile once per prompt length in a session."""
    from models.generate import GreedyDecoder
    from models.loader import load_model

    return GreedyDecoder(load_model(default_gguf, dtype="float32"), max_len=256)


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_gguf):
    """Gemma 3's tokenizer with the registry's built-in gemma chat template (its file has
    none); building its 262,144-piece vocabulary takes seconds, so once a session."""
    from models.tokenizer import Tokenizer

    return Tokenizer.for_model(gemma3_gguf)


SERVER_KEY = "sk-xlaserve-test"
# The live server's limits (the in-process engine of the parity test uses the same).
SERVER_LIMITS = {"max_model_len": 512, "max_num_seqs": 16, "max_num_batched_tokens": 64}


def default_model_server(log, *extra: str):
    """A context: `python -m server` on 127.0.0.1 serving the default model with the live
    server's key and limits (and `extra` flags); yields its base URL."""
    from servers import running_server

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SERVER_LIMITS.items()]
    return running_server(["--api-key", SERVER_KEY, "--max-waiting-requests", "256", *flags,
                           *extra], log)


@pytest.fixture(scope="session")
def live_server(default_gguf, tmp_path_factory):
    """`python -m server` on 127.0.0.1 serving the default model: yields its base URL."""
    with default_model_server(tmp_path_factory.mktemp("server") / "server.log") as url:
        yield url
