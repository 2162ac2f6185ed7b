"""Tensor parallelism on 8 fake CPU devices (conftest sets
--xla_force_host_platform_device_count=8): every size gives the same logits and greedy
tokens as one device, each device holds its share, and the engine compiles nothing after
warmup."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from tiny_models import save_tiny_hf

from engine.config import EngineConfig
from engine.device import kv_pages
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from models.generate import GreedyDecoder
from models.loader import load_config, load_model
from models.registry import param_specs
from models.sharding import make_mesh, sharded_config

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

IDS = [5, 17, 3, 99, 42, 7, 150, 23, 61, 8, 200, 11, 77, 31, 2, 9, 120, 64, 33, 180]


TINY = {
    # 8 KV heads: split as they are at every size
    "mha": dict(num_key_value_heads=8, tie_word_embeddings=False),
    # 2 KV heads: repeated to 4 and 8 at sizes 4 and 8; q/k/v biases (Qwen2)
    "gqa-bias": dict(num_key_value_heads=2, tie_word_embeddings=True, family="qwen2"),
    # q/k head norms split with their heads (Qwen3)
    "qwen3": dict(num_key_value_heads=4, tie_word_embeddings=True, family="qwen3"),
    # one KV head repeated to every device; sliding and full layers (Gemma 3)
    "gemma3": dict(num_key_value_heads=1, family="gemma3"),
}


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request, tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp(request.param), **TINY[request.param])


# The engine's own mechanisms (compile table, quantized and int8-KV splits) do not depend on
# the family: those tests run on the two Llama-shaped models only.
LLAMA_SHAPES = ("mha", "gqa-bias")


@pytest.fixture(scope="module")
def llama_tiny_models(tmp_path_factory):
    """name -> the tiny model of that Llama shape, each saved once."""
    saved = {}

    def get(name: str):
        if name not in saved:
            saved[name] = save_tiny_hf(tmp_path_factory.mktemp(name), **TINY[name])
        return saved[name]
    return get


@pytest.fixture(scope="module", params=LLAMA_SHAPES)
def llama_tiny(request, llama_tiny_models):
    return llama_tiny_models(request.param)


def _decoder(path, size: int, backend: str = "reference") -> GreedyDecoder:
    mesh = None if size == 1 else make_mesh(size)
    return GreedyDecoder(load_model(path, dtype="float32", attention_backend=backend, mesh=mesh),
                         max_len=128)


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def one_device(tiny):
    """The tiny model on one device: IDS's logits and 12 greedy tokens, what every size of
    it must give."""
    one = _decoder(tiny, 1)
    logits, tokens = one.prompt_logits(IDS), one.generate(IDS, 12)[0]
    assert len(set(tokens)) > 1, "degenerate model: greedy output repeats one token"
    return logits, tokens


SLOW = pytest.mark.slow


# Size 8 splits every family furthest (and repeats one or two KV heads the most); sizes 2 and
# 4 split them in the tests below as well, so here they wait for -m slow.
@pytest.mark.parametrize("size", [pytest.param(2, marks=SLOW), pytest.param(4, marks=SLOW), 8])
def test_sizes_agree_on_tiny_models(tiny, one_device, size):
    logits, tokens = one_device
    dec = _decoder(tiny, size)
    assert _rel(dec.prompt_logits(IDS), logits) < 1e-5
    assert dec.generate(IDS, 12)[0] == tokens


def one_family(name: str):
    """`tiny` as `name` alone in the default suite, the other families under -m slow: for a
    mechanism the family does not change (test_sizes_agree_on_tiny_models splits them all)."""
    return pytest.mark.parametrize("tiny", [
        pytest.param(f, marks=() if f == name else SLOW) for f in TINY], indirect=True)


@one_family("gemma3")  # one KV head repeated to every shard, sliding and full layers
def test_pallas_kernel_runs_per_shard(tiny, one_device):
    # The Pallas GPU kernel (interpreted here) under shard_map, one call per device.
    assert _decoder(tiny, 4, backend="pallas").generate(IDS, 8)[0] == one_device[1][:8]


@one_family("gemma3")
@pytest.mark.parametrize("size", [pytest.param(2, marks=SLOW), 8])
def test_orbax_checkpoint_loads_into_shards(tiny, one_device, size, tmp_path):
    from models.convert import convert

    ckpt = convert(tiny, tmp_path / "ckpt", "float32")
    assert _rel(_decoder(ckpt, size).prompt_logits(IDS), one_device[0]) < 1e-5


def test_each_device_holds_its_share(tiny):
    size = 4
    cfg = sharded_config(load_config(tiny), size)
    engine_cfg = EngineConfig(model=str(tiny), dtype="float32", max_model_len=128,
                              max_num_seqs=4, max_num_batched_tokens=32, num_blocks=33,
                              tensor_parallel_size=size)
    runner = ModelRunner(engine_cfg)
    state = jax.tree.leaves(runner.state)
    split = [a for a in state if not a.sharding.is_fully_replicated]
    L, H, D = cfg.num_layers, cfg.num_heads, cfg.head_dim
    assert {a.shape for a in split} >= {(L, H * D, 128), (256, 128)}  # wq [L, out, in], [V, E]
    for a in split + [runner.kv.k, runner.kv.v]:
        shards = a.addressable_shards
        assert len(shards) == size and len({s.device for s in shards}) == size
        for s in shards:
            assert math.prod(s.data.shape) * size == a.size, (a.shape, s.data.shape)
    # Per device, the split parameters are 1/size of the model's; only norms are replicated.
    replicated = sum(a.size for a in state if a.sharding.is_fully_replicated)
    norms = [s for name, s in param_specs(cfg).items() if "norm" in name]
    assert len(norms) >= 3 and replicated == sum(math.prod(s.shape) for s in norms)
    assert runner.kv.k.shape[3] == max(cfg.num_kv_heads, size)


def test_default_model_at_a_size_dividing_its_heads(default_gguf, tokenizer, default_decoder):
    size = 3  # SmolLM2-135M: 9 heads, 3 KV heads
    one, three = default_decoder, _decoder(default_gguf, size)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = tokenizer.encode(prompt)
        assert _rel(three.prompt_logits(ids), one.prompt_logits(ids)) < 1e-5
        assert three.generate(ids, 12)[0] == one.generate(ids, 12)[0]


def test_sizes_that_do_not_divide_the_heads_fail_at_startup(default_gguf):
    with pytest.raises(ValueError, match="tensor parallel size 2 does not divide the "
                                         "model's 9 attention heads"):
        load_model(default_gguf, mesh=make_mesh(2))
    cfg = EngineConfig(model=str(default_gguf), tensor_parallel_size=4)
    with pytest.raises(ValueError, match="9 attention heads"):
        kv_pages(cfg)
    with pytest.raises(ValueError, match="needs 16 devices; 8 available"):
        make_mesh(16)


# The compile table is the same for both shapes: one by default, the other under -m slow.
@pytest.mark.parametrize("shape", ["gqa-bias", pytest.param("mha", marks=pytest.mark.slow)])
def test_no_compilation_after_warmup_under_tensor_parallelism(llama_tiny_models, shape):
    tiny = llama_tiny_models(shape)
    engine_cfg = EngineConfig(model=str(tiny), dtype="float32", max_model_len=128,
                              max_num_seqs=4, max_num_batched_tokens=32, num_blocks=33,
                              tensor_parallel_size=2)
    engine = LLMEngine(engine_cfg, detokenize=False)  # the tiny model's word-level tokenizer
    engine.runner.warmup()
    plain = _decoder(tiny, 1)
    prompts = [IDS, IDS[:7], IDS[3:] * 2]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10,
                                                   ignore_eos=True))
    assert engine.runner.compilations_after_warmup == 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == plain.generate(prompt, 10)[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks



# At size 4 the 2 KV heads of gqa-bias are repeated and mha's 8 split; size 2 (-m slow) adds
# a split of 2 KV heads as they are.
SIZES_2_4 = pytest.mark.parametrize("size", [pytest.param(2, marks=SLOW), 4])


# int4's groups where KV heads repeat, and w8a8 (per-channel int8 weights, as int8's) by
# default; every pair under -m slow.
@pytest.mark.parametrize("shape, quantization", [
    ("gqa-bias", "int4"), ("mha", "w8a8"),
    *(pytest.param(shape, q, marks=SLOW) for shape, q in [
        ("mha", "int8"), ("gqa-bias", "int8"), ("mha", "int4"), ("gqa-bias", "w8a8")])])
@SIZES_2_4
def test_quantized_weights_split_consistently(llama_tiny_models, shape, quantization, size,
                                              monkeypatch):
    tiny = llama_tiny_models(shape)
    # Values and their scales are split along the same rows (or groups): the size gives the
    # one-device tokens. int4's head is in two row blocks (64 frequent rows here).
    monkeypatch.setattr("ops.vocab_blocks.FREQUENT_ROWS", 64)
    def decoder(size):
        mesh = None if size == 1 else make_mesh(size)
        return GreedyDecoder(load_model(tiny, dtype="float32", mesh=mesh,
                                        quantization=quantization), max_len=128)

    one, dec = decoder(1), decoder(size)
    assert _rel(dec.prompt_logits(IDS), one.prompt_logits(IDS)) < 1e-5
    assert dec.generate(IDS, 12)[0] == one.generate(IDS, 12)[0]


@pytest.mark.parametrize("llama_tiny", ["gqa-bias", pytest.param("mha", marks=SLOW)],
                         indirect=True)  # the repeated KV heads' scales split hardest
@SIZES_2_4
def test_int8_kv_pages_split_with_their_scales(llama_tiny, size):
    tiny = llama_tiny
    # Pages and their per-token scales are split by the same KV heads: the size gives the
    # one-device logits and tokens of int8 pages.
    def decoder(size):
        mesh = None if size == 1 else make_mesh(size)
        return GreedyDecoder(load_model(tiny, dtype="float32", mesh=mesh), max_len=128,
                             kv_dtype="int8")

    one, dec = decoder(1), decoder(size)
    assert one.new_cache().quantized
    # A K/V value a float rounding away from an int8 step boundary may round the other way
    # on another split: logits then differ by ~1/127 of a scale, not 1e-6.
    assert _rel(dec.prompt_logits(IDS), one.prompt_logits(IDS)) < 2e-3
    assert dec.generate(IDS, 12)[0] == one.generate(IDS, 12)[0]
