"""`--attention-backend`: our CPU kernel and the Pallas kernels (interpreted on CPU) drive the
real default model through the engine to the same greedy tokens as the pure-JAX reference."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from ops.attention import check_backend

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea, the light keeper and the engine that never sleeps, "
    "in four lines, each one longer than the one before it, and then explain the metaphor.",
    "1, 2, 3, 5, 8,",
]


def _greedy(default_gguf, backend: str) -> list[list[int]]:
    # 32 tokens per step: the long prompt is prefilled in chunks next to the others' decodes.
    cfg = EngineConfig(model=str(default_gguf), dtype="float32", max_model_len=256,
                       max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
                       attention_backend=backend)
    engine = LLMEngine(cfg)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12,
                                                   ignore_eos=True))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference_tokens(default_gguf):
    return _greedy(default_gguf, "reference")


@pytest.mark.parametrize("backend", [
    "cpu",  # ops/native/attention.cc, the CPU's auto backend
    # On CPU: the GPU kernel, interpreted (its values against the reference on every case:
    # test_pallas_gpu_attention.py; the default model through it: the GPU kit's parity)
    pytest.param("pallas", marks=pytest.mark.slow),
    pytest.param("pallas-tpu", marks=pytest.mark.slow),  # TPU interpret mode: about 3 minutes
])
def test_pallas_greedy_equals_reference(default_gguf, reference_tokens, backend):
    assert _greedy(default_gguf, backend) == reference_tokens


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*reference"):
        check_backend("flash")


def test_auto_picks_the_kernel_by_platform_and_compute_capability():
    import types

    import jax

    from ops import native
    from ops.attention import resolve_backend

    def device(platform, cc=None):
        return types.SimpleNamespace(platform=platform, compute_capability=cc)

    # our kernel where it was built
    on_cpu = "cpu" if native.available("attention") else "reference"
    assert resolve_backend("auto", device("cpu")) == on_cpu
    assert resolve_backend("auto", device("tpu")) == "pallas-tpu"
    assert resolve_backend("auto", device("gpu", "9.0")) == "pallas-gpu"   # Hopper: it ran there
    assert resolve_backend("auto", device("gpu", "8.0")) == "pallas-gpu"   # Ampere
    assert resolve_backend("auto", device("gpu", "7.5")) == "reference"    # Turing: no Triton path
    assert resolve_backend("auto", device("gpu")) == "reference"           # ROCm / unknown
    assert resolve_backend("pallas-gpu", device("cpu")) == "pallas-gpu"    # named: as asked
    assert resolve_backend("auto") == (on_cpu if jax.default_backend() == "cpu"
                                       else resolve_backend("auto", jax.devices()[0]))
