"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers, and
its Orbax round trip."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from models.generate import GreedyDecoder
from models.loader import load_model
from models.tokenizer import Tokenizer

PROMPTS = Path(__file__).parent / "data" / "parity_prompts.txt"


@pytest.fixture(scope="module")
def decoder(default_gguf):
    return GreedyDecoder(load_model(default_gguf, dtype="float32"), max_len=512)


@pytest.fixture(scope="module")
def reference(default_gguf):
    from models.parity import load_reference

    return load_reference(default_gguf)


# Every parity prompt; 24 new tokens each in the default run (~25 s), the 64 of
# `python -m models.parity` under -m slow (~50 s).
@pytest.mark.parametrize("new_tokens", [24, pytest.param(64, marks=pytest.mark.slow)])
def test_greedy_parity_with_transformers(default_gguf, decoder, reference, new_tokens):
    from models.parity import compare, encode_prompt, read_prompts

    tokenizer = Tokenizer.from_path(default_gguf)
    prompts = [encode_prompt(tokenizer, p) for p in read_prompts(PROMPTS)]
    assert len(prompts) >= 8
    assert max(len(p) for p in prompts) >= 300, "need prompts several hundred tokens long"
    results = [compare(decoder, reference, p, new_tokens) for p in prompts]
    report = "\n".join(f"prompt {i}: {r.describe()}" for i, r in enumerate(results))
    assert all(r.passed for r in results), report
    assert all(len(r.ours) == new_tokens for r in results)


def test_orbax_round_trip_gives_identical_logits(default_gguf, decoder, tmp_path):
    from models.convert import convert

    ckpt = convert(default_gguf, tmp_path / "ckpt", "float32")
    reloaded = GreedyDecoder(load_model(ckpt, dtype="float32"), max_len=512)
    ids = Tokenizer.from_path(ckpt).encode("Orbax keeps every bit of the weights.")
    assert ids == Tokenizer.from_path(default_gguf).encode("Orbax keeps every bit of the weights.")
    np.testing.assert_array_equal(reloaded.prompt_logits(ids), decoder.prompt_logits(ids))


def test_bfloat16_tracks_float32(default_gguf, decoder):
    ids = Tokenizer.from_path(default_gguf).encode("The quick brown fox jumps over the lazy dog")
    ref = decoder.prompt_logits(ids)
    bf16 = GreedyDecoder(load_model(default_gguf, dtype="bfloat16"), max_len=512)
    assert bf16.state["embed"][...].dtype == jnp.bfloat16
    assert bf16.state["layers"]["wq"][...].dtype == jnp.bfloat16
    got = bf16.prompt_logits(ids)
    assert got.dtype == np.float32
    # bf16 rounding moves logits by a fraction of their spread, not by their scale.
    assert np.abs(got - ref).max() < 0.25 * ref.std()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8
