"""A decoder served with --task embed: its pooled final hidden states (by default the last
token's, normalised, as vLLM pools a decoder) equal transformers' (the same float32 weights),
whatever the rows batched beside them. (Mean and CLS pooling: tests/test_bert.py.)"""

import numpy as np
import pytest

from engine.config import EngineConfig

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.",
         "def add(a, b):\n    return a + b", "Ein kurzer deutscher Satz über das Wetter.",
         "short", "A longer sentence about the history of the printing press, which changed "
                  "how knowledge spread."]


@pytest.fixture(scope="module")
def reference(default_gguf):
    """transformers' final-normed hidden states of each text (float32 weights)."""
    import torch

    from models.parity import load_reference

    model = load_reference(default_gguf)
    return model, torch


@pytest.fixture(scope="module")
def runner(default_gguf):
    from engine.embedding_runner import EmbeddingRunner

    runner = EmbeddingRunner(EngineConfig(model=str(default_gguf), task="embed",
                                          quantization="none", max_model_len=32,
                                          max_num_seqs=4, max_num_batched_tokens=32))
    runner.warmup()
    return runner


def states(reference, ids):
    model, torch = reference
    with torch.no_grad():
        out = model.model(torch.tensor([ids]))
    return out.last_hidden_state[0].double().numpy()  # [L, E], after the final norm


def cosine(a, b):
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


def test_pooled_states_equal_transformers_in_any_batch(runner, reference):
    ids = [runner.encode(t) for t in TEXTS]
    assert 16 < max(map(len, ids)) <= 32
    assert runner.pooling.mode == "last" and runner.pooling.normalize
    last = {}
    for i, x in enumerate(ids):
        state = states(reference, x)[-1]
        last[i] = state / np.linalg.norm(state)
    # alone, then two or three packed together (and padded), each row's vector the same
    for group in ([0], [5], [2, 3], [4, 5], [1, 4, 0]):
        total = sum(len(ids[i]) for i in group)
        size, rows = next(b for b in runner.buckets if b[0] >= total and b[1] >= len(group))
        tokens = np.zeros(size, np.int32)  # the rows packed, padding after them
        tokens[:total] = np.concatenate([ids[i] for i in group])
        lengths = np.zeros(rows, np.int32)
        lengths[:len(group)] = [len(ids[i]) for i in group]
        out = runner.run(tokens, lengths)
        assert np.isfinite(out).all()
        for row, i in enumerate(group):
            got = out[row].astype(np.float64)
            assert cosine(got, last[i]) >= 0.9999, (TEXTS[i], cosine(got, last[i]))
            assert np.allclose(got, last[i], atol=1e-3 * np.abs(last[i]).max())
    assert runner.compilations_after_warmup == 0


@pytest.mark.slow
def test_pooled_states_of_200_texts_equal_transformers(default_gguf, reference):
    """The embeddings' 200 parity texts (tests/data/embedding_texts.json) through the default
    model's last-token states, packed as the server packs them."""
    import json
    from pathlib import Path

    from engine.embedding_runner import EmbeddingRunner

    texts = json.loads((Path(__file__).parent / "data" / "embedding_texts.json").read_text())[
        "texts"]
    runner = EmbeddingRunner(EngineConfig(model=str(default_gguf), task="embed",
                                          quantization="none", max_model_len=512))
    runner.warmup()
    ids = [runner.encode(t) for t in texts]
    assert len(texts) == 200 and max(map(len, ids)) <= 512
    groups, group = [], []  # in order, up to 512 tokens and 8 texts a step
    for x in ids:
        if group and (sum(map(len, group)) + len(x) > 512 or len(group) == 8):
            groups.append(group)
            group = []
        group.append(x)
    groups.append(group)
    worst = 1.0
    for group in groups:
        total = sum(map(len, group))
        size, rows = next(b for b in runner.buckets if b[0] >= total and b[1] >= len(group))
        tokens = np.zeros(size, np.int32)
        tokens[:total] = np.concatenate(group)
        lengths = np.zeros(rows, np.int32)
        lengths[:len(group)] = [len(x) for x in group]
        out = runner.run(tokens, lengths)
        for row, x in enumerate(group):
            state = states(reference, x)[-1]
            worst = min(worst, cosine(out[row].astype(np.float64), state))
    assert worst >= 0.9999, worst
    assert runner.compilations_after_warmup == 0
