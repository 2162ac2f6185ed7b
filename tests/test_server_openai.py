"""The official `openai` client against a live `python -m server` on 127.0.0.1 running the
default model: results, wire format, usage, disconnects, and parity with the engine."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from conftest import SERVER_KEY, SERVER_LIMITS

from models.known_models import SERVED_NAME
from ops import native

MODEL = SERVED_NAME
GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key=SERVER_KEY, max_retries=0)


def metrics(url: str) -> dict[str, float]:
    """The server's `xlaserve:` series by name (its one model's), and the process's own
    (`process_resident_memory_bytes`, ...), from one scrape."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {SERVER_KEY}"}).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(?:xlaserve:(\w+)\{model_name="[^"]+"\}|(process_\w+)) (\S+)$', line)
        if m:
            out[m.group(1) or m.group(2)] = float(m.group(3))
    return out


async def wait_for(cond, timeout=30.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if cond():
            return True
        await asyncio.sleep(0.1)
    return False


def idle(url: str) -> bool:
    m = metrics(url)
    return (m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
            and m["num_free_kv_blocks"] == m["num_kv_blocks"])


# ---- check 1: results through the official client ---------------------------------------------


def test_metrics_report_the_kv_pool_and_weight_bytes(live_server):
    m = metrics(live_server)
    page = 2 * 30 * 16 * 3 * 64 * 2  # a 16-token float16 page of SmolLM2-135M (CPU default)
    assert m["kv_cache_bytes"] == (m["num_kv_blocks"] + 1) * page  # page 0 included
    # The file's Q4_1 / Q8_0 blocks (--quantization auto): a byte a value, or the 4-bit
    # layers two values a byte where the CPU kernel runs (ops/native)
    lo, hi = (0.17, 0.19) if native.available("qmatmul") else (0.26, 0.29)
    assert lo < m["weight_bytes"] / (4 * 134_515_008) < hi


def test_models_list(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_and_usage_match_the_tokenizer(client, tokenizer):
    prompt = "The three primary colors are"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY,
                                  **IGNORE_EOS)
    assert r.object == "text_completion" and r.model == MODEL
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # the text is what the tokenizer makes of the generated tokens
    ids = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    token_ids = ids.choices[0].model_extra["token_ids"]
    assert len(token_ids) == 12
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == choice.text


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, **GREEDY, **IGNORE_EOS)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_whole_and_streamed(client, tokenizer):
    from models.chat_template import ChatTemplate

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **GREEDY)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    rendered = ChatTemplate.for_tokenizer(tokenizer).render(messages, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                 stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    if r.choices[0].finish_reason == "stop":  # EOS ended it: fewer tokens than allowed
        assert r.usage.completion_tokens < 24


def test_n_2_and_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, n=2,
                  temperature=1.0, **IGNORE_EOS)
    a = client.completions.create(**kwargs, seed=1234)
    b = client.completions.create(**kwargs, seed=1234)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 20
    others = [client.completions.create(**kwargs, seed=s).choices[0].text for s in (1, 2, 3)]
    assert len({a.choices[0].text, *others}) > 1  # different seeds, different samples
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}],
                max_tokens=8, n=2, temperature=1.0, seed=7)
    assert ([c.message.content for c in client.chat.completions.create(**chat).choices]
            == [c.message.content for c in client.chat.completions.create(**chat).choices])


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6, logprobs=3,
                                  **GREEDY, **IGNORE_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    content = c.choices[0].logprobs.content
    assert "".join(t.token for t in content) == c.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert bytes(t.bytes).decode() == t.token


def test_stop_strings(client):
    kwargs = dict(model=MODEL, prompt="Here is a list of colors: red,", max_tokens=24, **GREEDY,
                  **IGNORE_EOS)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 3:len(full) // 3 + 3]
    assert stop.strip(), full
    r = client.completions.create(**kwargs, stop=[stop, "never appears"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    streamed = client.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_prefix_cache_hits_show_as_cached_tokens(client, live_server):
    prompt = "A long shared system prompt: " + " ".join(f"rule {i} is kept;" for i in range(20))
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    first = client.completions.create(**kwargs).usage
    hits_before = metrics(live_server)["prefix_cache_hits_total"]
    second = client.completions.create(**kwargs).usage
    assert first.prompt_tokens == second.prompt_tokens > 64
    assert first.prompt_tokens_details.cached_tokens == 0
    # every full 16-token block of the prompt is reused
    # every full block but the one holding the last token (that one is computed privately)
    assert second.prompt_tokens_details.cached_tokens == (second.prompt_tokens - 1) // 16 * 16
    assert metrics(live_server)["prefix_cache_hits_total"] > hits_before


def test_tokenize_and_detokenize(live_server, tokenizer):
    headers = {"Authorization": f"Bearer {SERVER_KEY}"}
    r = httpx.post(f"{live_server}/tokenize", json={"prompt": "Hello world"}, headers=headers)
    assert r.json() == {"count": len(tokenizer.encode("Hello world")),
                        "max_model_len": SERVER_LIMITS["max_model_len"],
                        "tokens": tokenizer.encode("Hello world")}
    back = httpx.post(f"{live_server}/detokenize", json={"tokens": r.json()["tokens"]},
                      headers=headers)
    assert back.json() == {"prompt": "Hello world"}


# ---- check 2 (live): errors through the client, and the server goes on ------------------------


def test_errors_through_the_client(client, live_server):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        client.completions.create(model=MODEL, prompt="word " * 600, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-0.5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="hi")
    bad = openai.OpenAI(base_url=f"{live_server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


# ---- check 4: 64 streams, a quarter of them leave mid-stream -----------------------------------


def test_64_streams_with_disconnects(live_server):
    before = metrics(live_server)
    n_tokens, n_clients = 24, 64
    client = openai.AsyncOpenAI(base_url=f"{live_server}/v1", api_key=SERVER_KEY, max_retries=0)

    async def one(i: int):
        stream = await client.completions.create(
            model=MODEL, prompt=f"Story number {i}:", max_tokens=n_tokens, stream=True,
            stream_options={"include_usage": True}, temperature=0.8, seed=i, **IGNORE_EOS)
        leaves = i % 4 == 0
        chunks = 0
        async for chunk in stream:
            if chunk.choices:
                chunks += 1
            if leaves and chunks == 3:
                await stream.close()  # the client disconnects
                return None
            if chunk.usage is not None:
                return chunk.usage.completion_tokens
        raise AssertionError("the stream ended without a usage chunk")

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(n_clients)))
        assert [r for i, r in enumerate(results) if i % 4] == [n_tokens] * (n_clients * 3 // 4)
        assert await wait_for(lambda: idle(live_server))

    asyncio.run(main())
    after = metrics(live_server)
    assert after["request_aborts_total"] - before["request_aborts_total"] == n_clients // 4
    assert after["kv_cache_usage_perc"] == 0
    assert after["compilations_after_warmup_total"] == 0
    assert after["engine_restarts_total"] == 0


def test_non_streaming_disconnect_aborts(live_server):
    before = metrics(live_server)["request_aborts_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_server}/v1/completions", timeout=1.5,
                   headers={"Authorization": f"Bearer {SERVER_KEY}"},
                   json={"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 480,
                         "ignore_eos": True})

    async def main():
        assert await wait_for(lambda: metrics(live_server)["request_aborts_total"] == before + 1,
                              timeout=10)
        assert await wait_for(lambda: idle(live_server), timeout=10)

    asyncio.run(main())


# ---- check 5: the HTTP API and the engine give the same greedy tokens --------------------------


@pytest.fixture(scope="module")
def engine(default_gguf):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(default_gguf), **SERVER_LIMITS))


@pytest.mark.parametrize("prompt", ["The quick brown fox", "def fibonacci(n):",
                                    "<|im_start|>user\nWrite a haiku.<|im_end|>\n"])
def test_greedy_http_equals_engine_generate(client, engine, prompt):
    from engine.sampling_params import SamplingParams

    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=32))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, **GREEDY,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == out.outputs[0].token_ids
    assert choice.text == out.outputs[0].text
    assert choice.finish_reason == out.outputs[0].finish_reason
