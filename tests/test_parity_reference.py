"""`python -m models.parity --save-reference / --reference`: the transformers reference's
greedy tokens carried as a file to a machine that cannot run transformers, and the
agreement measured from it equal to the live one."""

from __future__ import annotations

import functools
import json

import pytest
from tiny_models import save_tiny_hf

import models.parity
from models.parity import main

MAX_TOKENS = 8
PROMPTS = ["t5 t17 t99 t4", "t3 t200 t8 t42 t150 t9 t11"]
PROMPT_IDS = [[5, 17, 99, 4], [3, 200, 8, 42, 150, 9, 11]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (HF directory) whose word-level tokenizer splits on spaces, so
    a prompt line "t5 t17" is the ids [5, 17]."""
    from tokenizers import Tokenizer
    from tokenizers.pre_tokenizers import WhitespaceSplit

    path = save_tiny_hf(tmp_path_factory.mktemp("tiny-llama"))
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture
def prompts(tmp_path):
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(PROMPTS) + "\n")
    return file


def parity_line(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("PARITY ")]
    assert len(lines) == 1, out
    return json.loads(lines[0].removeprefix("PARITY "))


def refuse_to_load(*args, **kwargs):
    raise AssertionError("our model must not be loaded here")


def test_saved_reference_gives_the_live_agreement(tiny, prompts, tmp_path, capsys,
                                                  monkeypatch):
    for name in ("load_model", "load_reference"):  # load each model once
        monkeypatch.setattr(models.parity, name, functools.cache(getattr(models.parity, name)))
    argv = ["--model", str(tiny), "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS)]
    saved = tmp_path / "ref.json"

    with monkeypatch.context() as m:
        m.setattr(models.parity, "load_model", refuse_to_load)
        assert main([*argv, "--save-reference", str(saved)]) == 0
    ref = json.loads(saved.read_text())
    assert ref["model"] == tiny.name and ref["max_tokens"] == MAX_TOKENS
    assert [p["prompt"] for p in ref["prompts"]] == PROMPT_IDS
    assert all(len(p["tokens"]) == MAX_TOKENS for p in ref["prompts"])
    assert saved.stat().st_size < 1000  # token ids only, no logits
    capsys.readouterr()

    assert main([*argv, "--dtype", "float32", "--min-agreement", "1.0"]) == 0
    live = parity_line(capsys.readouterr().out)
    with monkeypatch.context() as m:
        m.setattr(models.parity, "load_reference", refuse_to_load)
        assert main([*argv, "--dtype", "float32", "--reference", str(saved),
                     "--min-agreement", "1.0"]) == 0
    out = capsys.readouterr().out
    from_file = parity_line(out)

    # float32 on both sides of a tiny model: every teacher-forced argmax agrees.
    assert live["agreement"] == from_file["agreement"] == 1.0
    assert 0.0 <= live["kl"] < 1e-6
    assert from_file["kl"] is None and "KL not available" in out
    positions = len(PROMPTS) * MAX_TOKENS
    assert live["positions"] == from_file["positions"] == positions
    assert live["prompts"] == from_file["prompts"] == len(PROMPTS)
    assert from_file["dtype"] == "float32" and from_file["backend"] == "cpu"

    # --dtype loads our weights in that dtype; bfloat16 rounding may flip a few argmaxes.
    dtypes = []
    load_model = models.parity.load_model
    monkeypatch.setattr(models.parity, "load_model",
                        lambda *a, **kw: dtypes.append(kw["dtype"]) or load_model(*a, **kw))
    assert main([*argv, "--dtype", "bfloat16", "--reference", str(saved)]) == 0
    bf16 = parity_line(capsys.readouterr().out)
    assert dtypes == ["bfloat16"] and bf16["dtype"] == "bfloat16"
    assert 0.5 <= bf16["agreement"] <= 1.0 and bf16["positions"] == positions
    assert from_file["layer_loop"] == "auto" and not from_file["pallas_products"]  # a CPU

    # --layer-loop as the server's: the Pallas product of a layer read in place (interpreted
    # here) agrees with the float32 reference as the plain scan does.
    assert main([*argv, "--dtype", "float32", "--reference", str(saved),
                 "--layer-loop", "scan-pallas"]) == 0
    pallas = parity_line(capsys.readouterr().out)
    assert pallas["pallas_products"] and pallas["agreement"] == 1.0


def write_reference(path, prompt_ids, max_tokens=MAX_TOKENS, tokens=None):
    entries = [{"prompt": p, "tokens": tokens or [0] * max_tokens} for p in prompt_ids]
    path.write_text(json.dumps({"model": "tiny", "max_tokens": max_tokens,
                                "prompts": entries}))
    return path


@pytest.mark.parametrize("reference, why", [
    (dict(prompt_ids=[PROMPT_IDS[0], [3, 200, 8, 42, 150, 9, 12]]), "prompt 1"),
    (dict(prompt_ids=PROMPT_IDS[:1]), "1 prompts"),
    (dict(prompt_ids=PROMPT_IDS, max_tokens=4), "--max-tokens 4"),
    (dict(prompt_ids=PROMPT_IDS, tokens=[0] * (MAX_TOKENS - 1)), "prompt 0"),
])
def test_reference_made_for_other_prompts_is_refused(tiny, prompts, tmp_path, capsys,
                                                     monkeypatch, reference, why):
    monkeypatch.setattr(models.parity, "load_model", refuse_to_load)
    monkeypatch.setattr(models.parity, "load_reference", refuse_to_load)
    saved = write_reference(tmp_path / "ref.json", **reference)
    assert main(["--model", str(tiny), "--prompts", str(prompts), "--max-tokens",
                 str(MAX_TOKENS), "--dtype", "bfloat16", "--reference", str(saved)]) == 2
    err = capsys.readouterr().err
    assert why in err and str(saved) in err


def test_greedy_parity_from_a_saved_reference_is_refused(prompts, tmp_path, capsys):
    saved = write_reference(tmp_path / "ref.json", PROMPT_IDS)
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "unused.gguf", "--prompts", str(prompts), "--reference", str(saved)])
    assert exit_.value.code == 2
    assert "greedy parity needs the reference's logits" in capsys.readouterr().err
