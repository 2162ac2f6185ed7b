"""Qwen3 and Gemma 3 through the whole engine, on tiny random-weight models from transformers.

The engine's greedy tokens (batched, paged, chunked, prefix-cached, preempted) must equal
transformers' greedy decoding with a full forward pass per token (or diverge only at a
near-tie); the Pallas kernels (interpreted) must give the reference backend's logits with
Gemma 3's per-layer windows; the registry names what it supports. Logits parity is in
test_model_parity.py, GGUF files in test_gguf_weights.py, tensor parallelism and Orbax
checkpoints in test_tensor_parallel.py.
"""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from tiny_models import save_tiny_hf

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from models import registry
from models.config import ModelConfig
from models.generate import GreedyDecoder
from models.loader import load_model
from ops.quantization import from_lanes

GAP = 1e-3
rng = np.random.default_rng(0)
# Longer than Gemma 3's tiny window (8) and than one page; two share a 24-token prefix.
SHARED = [int(x) for x in rng.integers(1, 256, 24)]
PROMPTS = [SHARED + [7, 9], SHARED + [200], [int(x) for x in rng.integers(1, 256, 40)],
           [5, 17, 3], [int(x) for x in rng.integers(1, 256, 13)]]
NEW = 12
SLOW = pytest.mark.slow


def families(default: str):
    """`tiny` for one family in the default suite and the other behind `slow`: for checks of
    a mechanism that does not depend on the family (the engine test covers both)."""
    return pytest.mark.parametrize("tiny", [
        pytest.param(f, marks=() if f == default else SLOW) for f in ("qwen3", "gemma3")],
        indirect=True)


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def tiny(request, tmp_path_factory):
    path = save_tiny_hf(tmp_path_factory.mktemp(request.param), family=request.param,
                        num_key_value_heads=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def full_forward_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """transformers, no cache: the whole sequence through the model for every token."""
    ids, steps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
            steps.append(logits)
            ids.append(int(np.argmax(logits)))
    return ids[len(prompt):], np.stack(steps)


def _assert_greedy_like(got: list[int], want: list[int], logits: np.ndarray, what: str):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:  # only a near-tie of the reference may flip
            top2 = np.sort(logits[i])[-2:]
            gap = float(top2[1] - top2[0])
            assert a == int(np.argsort(logits[i])[-2]) and gap < GAP, (
                f"{what}: diverges at token {i}: {a} vs {b}, top-2 gap {gap:.2e}")
            return


def test_engine_greedy_equals_transformers_full_forward(tiny):
    family, path, hf = tiny
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=128, max_num_seqs=4,
                       max_num_batched_tokens=32, block_size=8)
    engine = LLMEngine(cfg, detokenize=False)  # the tiny model's word-level tokenizer
    engine.runner.warmup()
    p = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    refs = [full_forward_greedy(hf, prompt, NEW) for prompt in PROMPTS]
    assert len({tuple(r[0]) for r in refs}) == len(PROMPTS)  # the model is not degenerate

    outs = engine.generate(PROMPTS, p)  # 5 prompts over 4 sequences, 32-token chunks
    for out, (want, logits) in zip(outs, refs, strict=True):
        _assert_greedy_like(out.outputs[0].token_ids, list(want), logits, f"{family} batched")
    # Alone, after the others: its shared 24 tokens come from the prefix cache.
    hits = engine.block_manager.prefix_cache_hits
    cached = engine.generate([PROMPTS[1]], p)[0]
    assert engine.block_manager.prefix_cache_hits > hits and cached.num_cached_tokens >= 16
    assert cached.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert engine.runner.compilations_after_warmup == 0

    # A cache of 16 pages of 8 (one max_model_len sequence): sequences are preempted and
    # recomputed, and still give the same tokens.
    small = LLMEngine(dataclasses.replace(cfg, num_blocks=17), runner=engine.runner,
                      tokenizer=engine.tokenizer, detokenize=False)
    again = small.generate(PROMPTS, dataclasses.replace(p, max_tokens=NEW + 20))
    assert small.scheduler.num_preemptions > 0
    for out, first in zip(again, outs, strict=True):
        assert out.outputs[0].token_ids[:NEW] == first.outputs[0].token_ids
    for eng in (engine, small):
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks


# Gemma 3's windows through the GPU kernel here; the TPU kernel's windows and soft caps are
# in test_pallas_tpu_attention.py against the reference.
@families("gemma3")
@pytest.mark.parametrize("backend", ["pallas-gpu", pytest.param("pallas-tpu", marks=SLOW)])
def test_pallas_kernels_match_the_reference(tiny, backend):
    family, path, _ = tiny
    ids = PROMPTS[2]
    want = GreedyDecoder(load_model(path, dtype="float32"), max_len=64,
                         page_size=8).prompt_logits(ids)
    kernel = GreedyDecoder(load_model(path, dtype="float32", attention_backend=backend),
                           max_len=64, page_size=8)
    np.testing.assert_allclose(kernel.prompt_logits(ids), want, atol=1e-4, rtol=0)
    if backend == "pallas-gpu":  # lone decodes too: their K/V written in place, the work
        # items derived once a step (ops.attention.prepare)
        reference = GreedyDecoder(load_model(path, dtype="float32"), max_len=64, page_size=8)
        tokens = reference.generate(ids, 6)[0]
        np.testing.assert_allclose(kernel.decoded_logits(ids, tokens),
                                   reference.decoded_logits(ids, tokens), atol=1e-4, rtol=0)


@families("qwen3")  # Gemma 3's unrolled periods: test_every_layer_loop_gives_the_engine...
def test_unrolled_layers_equal_the_scan(tiny):
    """Unrolled layers (weights sliced at constant indices: the GPU's loop) give the scanned
    layers' logits: Gemma 3's kinds a period at a time and Qwen3's one kind."""
    family, path, _ = tiny
    ids = PROMPTS[2]
    scanned = load_model(path, dtype="float32")
    assert not scanned.unroll_layers  # the CPU's default
    want = GreedyDecoder(scanned, max_len=64, page_size=8).prompt_logits(ids)
    unrolled = load_model(path, dtype="float32")
    unrolled.unroll_layers = True
    got = GreedyDecoder(unrolled, max_len=64, page_size=8).prompt_logits(ids)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@families("qwen3")  # Gemma 3's float stack: test_every_layer_loop_gives_the_engine...
@pytest.mark.parametrize("quantization", [pytest.param(None, marks=SLOW), "int8", "int4"])
def test_stacked_products_equal_the_scan(tiny, quantization):
    """--layer-loop scan-pallas: float, per-channel int8 and int4 matrices (packed two a
    byte, groups of 32 with minimums) handed to ops/pallas_gpu_matmul as the stack and the
    layer index (interpreted on CPU, our CPU kernel off) give the sliced products' logits."""
    family, path, _ = tiny
    ids = PROMPTS[2]

    def model(stacked):
        m = load_model(path, dtype="float32", quantization=quantization)
        m.native_matmuls = False  # XLA's products, as on a GPU
        m.stacked_kernel = stacked
        if m.lanes:  # packed 4-bit values in `pack`'s order, as a GPU holds them
            for name, fmt in m.quant:
                if fmt.lanes:
                    top = not name.startswith("layers.")
                    param = getattr(m if top else m.layers, name.removeprefix("layers."))
                    param.value = from_lanes(param.value)
            m.lanes = False
        return m

    want = GreedyDecoder(model(False), max_len=64, page_size=8).prompt_logits(ids)
    stacked = model(True)
    layer = stacked.layer_params(nnx.to_pure_dict(nnx.state(stacked.layers)), jnp.int32(0))
    parts = {None: {"stack"}, "int8": {"q", "scale"}, "int4": {"q", "scale", "min"}}
    assert set(layer["wq"]) == parts[quantization] | {"layer"}  # the whole stack goes
    if quantization == "int4":
        assert layer["wq"]["q"].dtype == jnp.uint8  # packed
    got = GreedyDecoder(stacked, max_len=64, page_size=8).prompt_logits(ids)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)  # summed in another order


def test_auto_layer_loop_hands_float_products_the_stack_on_one_gpu(monkeypatch):
    from engine.config import LAYER_LOOPS
    from models import run_options
    assert EngineConfig(model="m").layer_loop == "auto" and LAYER_LOOPS == run_options.LAYER_LOOPS
    model = types.SimpleNamespace(mesh=None, native_matmuls=False, dtype=jnp.float32)

    def loop(layer_loop):
        run_options.set_run_options(model, layer_loop=layer_loop)
        return model.unroll_layers, model.stacked_kernel

    assert loop("auto") == (False, False)  # this CPU: the plain scan
    assert loop("scan-pallas") == (False, True)
    assert loop("unroll") == (True, False)
    monkeypatch.setattr(run_options.jax, "default_backend", lambda: "gpu")
    assert loop("auto") == (False, True) and loop("scan") == (False, False)
    model.mesh = object()  # a mesh: XLA's products
    assert loop("auto") == (False, False)
    model.native_matmuls = True  # the CPU kernel takes the stack itself
    assert loop("unroll") == (False, False)
    with pytest.raises(ValueError, match="layer_loop"):
        run_options.set_run_options(model, layer_loop="spiral")


def test_every_layer_loop_gives_the_engine_the_same_tokens(tmp_path):
    """--layer-loop: the engine's unrolled layers, and its scan with float products in
    ops/pallas_gpu_matmul (interpreted here), give the scanned layers' tokens, greedy and
    seeded, batched with chunked prefill. Gemma 3, whose scan takes a period of layer kinds
    an iteration (Qwen3's one kind: test_unrolled_layers_equal_the_scan)."""
    path = save_tiny_hf(tmp_path, family="gemma3", num_key_value_heads=2)
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=128, max_num_seqs=4,
                       max_num_batched_tokens=16, block_size=8)
    runs = {}
    for loop in ("scan", "unroll", "scan-pallas"):
        engine = LLMEngine(dataclasses.replace(cfg, layer_loop=loop), detokenize=False)
        model = nnx.merge(engine.runner.graphdef, engine.runner.state)
        assert model.unroll_layers == (loop == "unroll")
        assert model.stacked_kernel == (loop == "scan-pallas")
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
        runs[loop] = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy)
                      + engine.generate(PROMPTS, seeded)]
        engine.runner.release()
    assert runs["unroll"] == runs["scan"] == runs["scan-pallas"]


def test_registry_is_the_one_dispatch(tmp_path):
    assert registry.model_class("Qwen3ForCausalLM").__name__ == "Qwen3"
    assert registry.model_class("Gemma3ForCausalLM").__name__ == "Gemma3"
    assert registry.model_class("MistralForCausalLM").__name__ == "Llama"
    assert registry.gguf_family("gemma3")[1] == "Gemma3ForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*"
                                         "Qwen3ForCausalLM.*Gemma3ForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'.*qwen3.*gemma3"):
        registry.gguf_family("gpt2")
    # What a model's files declare, read without loading it, and the chat template it gets
    # when they carry none.
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    assert registry.declared_architecture(tmp_path) == "Qwen3ForCausalLM"
    assert registry.builtin_chat_template(tmp_path) == "chatml"
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert registry.builtin_chat_template(tmp_path) is None  # a Llama without one: an error
    assert registry.declared_architecture(tmp_path / "missing") is None
