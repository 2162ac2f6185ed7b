"""/v1/embeddings with all-MiniLM-L6-v2 through the official `openai` client, beside a
generating model: OpenAI's shapes, its encodings, bad inputs as 400s, and the routes of the
other task refused."""

import base64
import types

import httpx
import numpy as np
import openai
import pytest
from fakes import make_engine, serving

from engine.async_engine import Engines
from engine.config import EngineConfig
from engine.embedding_engine import EmbeddingEngine

NAME = "all-MiniLM-L6-v2"
LIMITS = {"max_num_seqs": 8, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def minilm():
    from models.known_models import fetch_model

    return fetch_model("all-minilm-l6-v2", quiet=True)


@pytest.fixture(scope="module")
def engine(minilm):
    engine = EmbeddingEngine(EngineConfig(model=str(minilm), name=NAME, **LIMITS))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine, tokenizer):
    chat, _ = make_engine(tokenizer, name="chat")  # a generating model beside it
    with serving(Engines({NAME: engine, "chat": chat})) as url:
        yield url
    chat.shutdown()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def cosine(a, b):
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_client_embeds_texts_and_token_ids(client, minilm, engine):
    texts = ["The cat sat on the mat.", "A kitten rested on the rug.",
             "Quarterly revenue rose by four percent.", "é" * 3 + " 東京 " * 20]
    out = client.embeddings.create(model=NAME, input=texts, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2, 3] and out.model == NAME
    vectors = np.array([d.embedding for d in out.data])
    assert vectors.shape == (4, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)  # the model normalises
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.3
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm / "tokenizer.json"))
    tokenizer.no_padding()  # (the file pads and truncates to 128)
    tokenizer.no_truncation()
    ids = [tokenizer.encode(t).ids for t in texts]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    # Token ids give the text's vector; each text alone gives what it gave in the batch.
    by_ids = client.embeddings.create(model=NAME, input=ids[:2], encoding_format="float")
    alone = client.embeddings.create(model=NAME, input=texts[2], encoding_format="float")
    pairs = ((by_ids.data[0].embedding, vectors[0]), (by_ids.data[1].embedding, vectors[1]),
             (alone.data[0].embedding, vectors[2]))
    for got, want in pairs:
        assert np.allclose(got, want, atol=1e-5)
    # base64: little-endian float32 (what the client decodes when it asks for it itself)
    raw = httpx.post(f"{client.base_url}embeddings", json={"model": NAME, "input": texts[:1],
                                                            "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert decoded.dtype == np.float32 and np.allclose(decoded, vectors[0], atol=1e-5)
    assert engine.stats().compilations_after_warmup == 0


def test_bad_inputs_are_400s_naming_what_is_wrong(url):
    cases = [({"input": []}, "input"), ({"input": [[]]}, "input"), ({"input": ""}, "input"),
             ({"input": [1.5, 2]}, "input"), ({"input": [[1, "a"]]}, "input"),
             ({"input": [-1]}, "input"), ({"input": [10**9]}, "vocabulary"),
             ({"input": "word " * 300}, "maximum context length of 256"),
             ({"input": [[101] * 257]}, "maximum context length of 256"),
             ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
             ({"input": "hi", "dimensions": 128}, "dimensions"),
             ({"input": "hi", "model": "nope"}, "nope")]
    for body, words in cases:
        r = httpx.post(f"{url}/v1/embeddings", json={"model": NAME, **body}, timeout=30)
        assert r.status_code in (400, 404), (body, r.status_code, r.text)
        error = r.json()["error"]
        assert words in error["message"] or words == error["param"], (body, error)


def test_each_model_serves_its_own_task(url, client):
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "embeddings" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/embeddings", json={"model": "chat", "input": "hi"})
    assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]
    assert {m.id for m in client.models.list()} == {NAME, "chat"}
    metrics = httpx.get(f"{url}/metrics").text
    assert f'xlaserve:prompt_tokens_total{{model_name="{NAME}"}}' in metrics


def test_dimensions_cut_a_matryoshka_models_vectors_and_normalise_again(tmp_path):
    from fakes import FakeEmbeddingRunner

    from engine.embedding_runner import truncations

    (tmp_path / "config.json").write_text('{"matryoshka_dimensions": [2, 768]}')
    assert truncations(str(tmp_path), 3) == (2,)  # (sizes past the model's are dropped)
    (tmp_path / "config.json").write_text('{"is_matryoshka": true}')
    assert truncations(str(tmp_path), 3) == (1, 2, 3)
    assert truncations(str(tmp_path / "absent"), 3) == ()

    class Matryoshka(FakeEmbeddingRunner):
        truncations = (2,)
        pooling = types.SimpleNamespace(normalize=True)

    cfg = EngineConfig(model="m", name="m", task="embed", max_num_seqs=8,
                       max_num_batched_tokens=64)
    engine = EmbeddingEngine(cfg, factory=Matryoshka)
    try:
        with serving(Engines({"m": engine})) as url:
            r = httpx.post(f"{url}/v1/embeddings", json={"input": [[3, 4]], "dimensions": 2})
            assert r.status_code == 200, r.text
            # the fake's vector [7, 2, 3] cut to [7, 2], normalised
            assert np.allclose(r.json()["data"][0]["embedding"], np.array([7, 2]) / np.hypot(7, 2))
            r = httpx.post(f"{url}/v1/embeddings", json={"input": "hi", "dimensions": 3})
            assert r.status_code == 400 and "one of 2" in r.json()["error"]["message"]
    finally:
        engine.shutdown()
