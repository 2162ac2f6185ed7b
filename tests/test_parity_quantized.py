"""`python -m models.parity --quantization`: top-1 agreement and KL(ref || ours) against
the float32 transformers reference, and the --min-agreement exit code."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

import models.parity
from models.parity import agreement_and_kl, main


def test_identical_logits_agree_fully_with_zero_kl():
    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32)
    agreement, kl = agreement_and_kl(logits, list(np.argmax(logits, axis=-1)), logits)
    assert agreement == 1.0
    assert kl == pytest.approx(0.0, abs=1e-12)


def test_agreement_counts_positions_where_our_argmax_is_the_reference_token():
    ref = np.eye(4, 5) * 3.0           # the reference picks tokens 0, 1, 2, 3
    ours = ref.copy()
    ours[2] = np.eye(5)[4] * 3.0       # we pick 4 at position 2
    agreement, _ = agreement_and_kl(ours, [0, 1, 2, 3], ref)
    assert agreement == 0.75


def test_kl_is_ref_given_ours_by_hand():
    # ref softmax [1/4, 3/4], ours [1/2, 1/2]; a large shared offset must not overflow.
    ref = np.array([[0.0, math.log(3.0)], [1000.0, 1000.0 + math.log(3.0)]])
    ours = np.array([[0.0, 0.0], [-1000.0, -1000.0]])
    agreement, kl = agreement_and_kl(ours, [1, 1], ref)
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # 0.1308 nats
    assert kl == pytest.approx(expected, rel=1e-12)
    assert agreement == 0.0  # our tie breaks to token 0, the reference's token is 1


def test_min_agreement_needs_quantization(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n")
    with pytest.raises(SystemExit):
        main(["--model", "unused.gguf", "--prompts", str(prompts), "--min-agreement", "0.5"])


@pytest.mark.slow  # a minute: the default model and its transformers reference, twice
def test_int4_default_model_agrees_and_min_agreement_sets_exit_code(default_gguf, tmp_path,
                                                                    capsys, monkeypatch):
    # Both runs load the same two models: load them once (the reference takes ~15 s).
    for name in ("load_model", "load_reference"):
        monkeypatch.setattr(models.parity, name,
                            functools.cache(getattr(models.parity, name)))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('The capital of France is\n'
                       '{"messages": [{"role": "user", "content": "Name a primary colour."}]}\n')
    argv = ["--model", str(default_gguf), "--prompts", str(prompts), "--max-tokens", "8",
            "--quantization", "int4"]
    assert main([*argv, "--min-agreement", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.count("top-1 agreement") == 3, out  # two prompts and the mean
    assert "mean over 2 prompts" in out
    assert main([*argv, "--min-agreement", "1.01"]) == 1
    assert "below --min-agreement 1.01" in capsys.readouterr().out


def test_teacher_forcing_decodes_each_token_as_the_server_does(default_gguf):
    # The default model's 4-bit products run in the CPU kernel for a lone row and in XLA for a
    # prompt's many rows: parity's forced positions must be the decode's numbers, bit for bit.
    from models.generate import GreedyDecoder
    from models.loader import load_model

    decoder = GreedyDecoder(load_model(default_gguf, dtype="float32", quantization="auto"),
                            max_len=64)
    prompt = [1, 504, 3575, 282, 4649, 314]
    tokens, logits = decoder.generate(prompt, 6)
    forced = decoder.decoded_logits(prompt, tokens)
    np.testing.assert_array_equal(forced, logits)
    # One pass over prompt and tokens runs other products: the same argmax, other bits.
    one_pass = decoder.prompt_logits(prompt + tokens[:-1])[len(prompt) - 1:]
    assert not np.array_equal(one_pass, forced)
    np.testing.assert_array_equal(one_pass.argmax(-1), forced.argmax(-1))
