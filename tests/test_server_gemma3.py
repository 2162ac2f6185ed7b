"""The server on a second family's real weights: Gemma 3 270M (base model, Q4_K_M GGUF, fetched
like the default model; Gemma terms), through the official client.

Its file carries no chat template, so the registry's built-in gemma template renders chats; a
prompt longer than the model's 512-token sliding window must give transformers' greedy tokens
(the parity prompts stay inside the window); stops end the reply as they should.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from openai import OpenAI

from models.chat_template import ChatTemplate

MODEL = "gemma-3-270m"
# One request at a time: its warmup compiles one head and sampler over the 262,144-token
# vocabulary (its costly executables), not one per sequence count up to 4.
LIMITS = ["--max-model-len", "1024", "--max-num-seqs", "1", "--max-num-batched-tokens", "64"]
STORY = ("The lighthouse keeper climbed the tower every evening, wound the clockwork, trimmed "
         "the wick and wrote the weather in his log. ")


@pytest.fixture(scope="module")
def server(gemma3_gguf, tmp_path_factory):
    from servers import running_server

    log = tmp_path_factory.mktemp("gemma3") / "server.log"
    with running_server(["--model", "gemma3-270m", *LIMITS], log) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_chats_render_with_the_built_in_gemma_template(server, gemma3_tokenizer):
    import httpx

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    got = httpx.post(f"{server}/tokenize", json={"model": MODEL, "messages": messages}).json()
    text = ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
            "<start_of_turn>model\n")
    assert ChatTemplate.for_tokenizer(gemma3_tokenizer).render(messages, True) == text
    assert got["tokens"] == gemma3_tokenizer.encode(text, add_special_tokens=False)
    assert got["tokens"][:2] == [2, 105]  # one BOS, then <start_of_turn>


# ~35 s; the tiny Gemma configs check per-layer windows against transformers in the default
# run (tests/test_model_families.py), this one the real model's.
@pytest.mark.slow
def test_beyond_the_sliding_window_greedy_equals_transformers(client, gemma3_gguf,
                                                             gemma3_tokenizer):
    import transformers

    prompt = STORY * 25  # ~600 tokens: the sliding layers see only the last 512
    ids = gemma3_tokenizer.encode(prompt)
    assert 550 < len(ids) < 1024 - 16
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    ours = got.choices[0].model_extra["token_ids"]

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name, dtype=torch.float32).eval()
    want, seq = [], list(ids)
    with torch.no_grad():
        out = ref(torch.tensor([seq]), use_cache=True)
        for _ in range(16):
            logits = out.logits[0, -1].numpy()
            token = int(np.argmax(logits))
            if token != ours[len(want)]:  # only a near-tie may flip
                gap = float(np.diff(np.sort(logits)[-2:])[0])
                assert ours[len(want)] == int(np.argsort(logits)[-2]) and gap < 1e-3, (
                    f"token {len(want)}: ours {ours[len(want)]}, transformers {token}")
                return
            want.append(token)
            out = ref(torch.tensor([[token]]), past_key_values=out.past_key_values,
                      use_cache=True)
    assert ours == want


def test_stops_end_the_reply(client):
    # The base model does not end its turns by itself (it never picks <end_of_turn>, as in
    # transformers): a stop string ends the reply, whole and streamed alike.
    messages = [{"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "What is 5 + 5?"}]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                          temperature=0)
    assert free.choices[0].finish_reason == "length" and "\n" in free.choices[0].message.content
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           temperature=0, stop=["\n"])
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"
    assert text and free.choices[0].message.content.startswith(text + "\n")
    assert "<end_of_turn>" not in text and "<start_of_turn>" not in text
    parts, finish = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                temperature=0, stop=["\n"], stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == text and finish == "stop"
