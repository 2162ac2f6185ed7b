"""Sampling defaults from the model: a request that leaves temperature, top_p, top_k, min_p or
repetition_penalty unset gets the model's recommended value (an HF directory's
generation_config.json, a known model's card), its own values win, `--generation-config vllm`
turns them off and `--override-generation-config` sets them; and a new user's first chat
with no sampling parameters answers sensibly."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import SERVER_KEY

from engine.launch import ModelSpec, sampling_defaults
from models.generation_config import FIELDS, generation_defaults, parse_overrides
from models.known_models import SERVED_NAME
from server.chat_protocol import ChatCompletionRequest
from server.protocol import CompletionRequest

CARD = {"temperature": 0.2, "top_p": 0.9}  # SmolLM2-135M-Instruct's card


def test_an_hf_directory_gives_its_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": None, "do_sample": True,
         "max_new_tokens": 9, "bos_token_id": 1}))
    values, source = generation_defaults(tmp_path)
    assert values == {"temperature": 0.6, "top_p": 0.95}  # the sampling fields it sets
    assert source == str(tmp_path / "generation_config.json")
    assert generation_defaults(tmp_path / "missing") == ({}, None)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        generation_defaults(tmp_path)


def test_a_known_model_has_its_cards_values_and_other_files_none(default_gguf, tmp_path):
    assert generation_defaults(default_gguf) == (CARD, "smollm2-135m's model card")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"")
    assert generation_defaults(other) == ({}, None)


def test_the_server_flags_choose_and_override_them(default_gguf):
    spec = ModelSpec("m", str(default_gguf))
    assert sampling_defaults(spec) == CARD
    assert sampling_defaults(spec, "vllm") == {}
    assert sampling_defaults(spec, "auto", {"temperature": 0.7}) == {"temperature": 0.7,
                                                                      "top_p": 0.9}
    assert sampling_defaults(spec, "vllm", {"top_k": 40}) == {"top_k": 40}
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults(spec, "auto", {"temperature": -1})
    assert parse_overrides('{"temperature": 0.5, "min_p": 0.05}') == {"temperature": 0.5,
                                                                      "min_p": 0.05}
    for bad, match in (('{"max_tokens": 5}', "unknown field"), ("[1]", "JSON object"),
                       ("{", "not JSON"), ('{"top_p": "0.9"}', "numbers")):
        with pytest.raises(ValueError, match=match):
            parse_overrides(bad)


def test_a_requests_own_values_win():
    messages = [{"role": "user", "content": "Hi"}]
    p = ChatCompletionRequest(messages=messages).to_sampling_params(CARD)
    assert (p.temperature, p.top_p, p.top_k) == (0.2, 0.9, 0)
    p = ChatCompletionRequest(messages=messages, temperature=1.0).to_sampling_params(CARD)
    assert (p.temperature, p.top_p) == (1.0, 0.9)  # sent, even at OpenAI's default: kept
    p = CompletionRequest(prompt="Hi", top_p=0.5).to_sampling_params(CARD)
    assert (p.temperature, p.top_p) == (0.2, 0.5)
    p = CompletionRequest(prompt="Hi").to_sampling_params(None)
    assert (p.temperature, p.top_p) == (1.0, 1.0)  # no defaults: OpenAI's


def test_every_value_a_model_may_set_reaches_its_requests():
    # server/ lists these fields apart from models/ (which it may not import): one missing
    # there would be dropped without a word.
    values = {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
              "repetition_penalty": 1.1}
    assert set(values) == set(FIELDS)
    p = CompletionRequest(prompt="Hi").to_sampling_params(values)
    assert {name: getattr(p, name) for name in FIELDS} == values


def test_a_new_users_first_chat_answers_with_paris(live_server):
    """The default server, a chat with no sampling parameters (seeds apart): at OpenAI's
    temperature 1 this 135M model answered nonsense; at its card's values, Paris."""
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key=SERVER_KEY, max_retries=0)
    answers = [client.chat.completions.create(
        model=SERVED_NAME, seed=seed, max_tokens=32,
        messages=[{"role": "user", "content": "Hi! What is the capital of France?"}],
    ).choices[0].message.content for seed in range(5)]
    assert sum("Paris" in a for a in answers) >= 4, answers
