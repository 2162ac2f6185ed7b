"""engine.LLM, the offline API: the same replies as the server for the same requests."""

from __future__ import annotations

import dataclasses

import openai
import pytest
from conftest import SERVER_KEY, SERVER_LIMITS

from engine.llm import LLM
from engine.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "Hi! What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, **SERVER_LIMITS)  # the default model, as the live server serves it


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key=SERVER_KEY, max_retries=0)


def test_chat_replies_as_the_server_does(llm, client):
    for params in (dict(temperature=0, max_tokens=24), dict(temperature=0.8, seed=5,
                                                             max_tokens=24)):
        served = client.chat.completions.create(model=llm.model_name, messages=MESSAGES,
                                                **params)
        # The request leaves top_p unset: the server gives it the model's, as LLM's defaults
        [out] = llm.chat(MESSAGES, dataclasses.replace(llm.get_default_sampling_params(),
                                                       **params))
        assert out.finished and out.outputs[0].text == served.choices[0].message.content
        assert out.outputs[0].finish_reason == served.choices[0].finish_reason


def test_completions_and_token_prompts_reply_as_the_server_does(llm, client):
    prompt = "The lighthouse keeper counted the ships"
    served = client.completions.create(model=llm.model_name, prompt=prompt, temperature=0.7,
                                       seed=11, max_tokens=20)
    params = dataclasses.replace(llm.get_default_sampling_params(), temperature=0.7, seed=11,
                                 max_tokens=20)
    by_text, by_ids = llm.generate(
        [prompt, {"prompt_token_ids": llm.get_tokenizer().encode(prompt)}], params)
    assert by_text.outputs[0].text == served.choices[0].text
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_unset_sampling_takes_the_models_defaults(llm, client):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (0.2, 0.9)  # SmolLM2's card
    # The server applies the same defaults to a request that leaves them unset.
    served = client.chat.completions.create(model=llm.model_name, messages=MESSAGES, seed=3,
                                            max_tokens=16)
    [out] = llm.chat(MESSAGES, SamplingParams(temperature=0.2, top_p=0.9, seed=3,
                                              max_tokens=16))
    assert out.outputs[0].text == served.choices[0].message.content
    [again] = llm.chat([MESSAGES])  # a list of conversations, no parameters: the defaults
    assert again.finished and again.outputs[0].text


def test_a_bad_prompt_says_what_a_prompt_is(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"text": "hello"})
