"""Broken weight files fail with an error naming the file and the tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from models.gguf_file import GGUFError
from models.loader import load_model
from models.weights import WeightError


def test_truncated_gguf_names_file_and_tensor(default_gguf, tmp_path):
    data = default_gguf.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(GGUFError) as e:
        load_model(bad)
    assert str(bad) in str(e.value)
    assert "blk." in str(e.value) and "truncated" in str(e.value)


def test_corrupt_gguf_header_names_file(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(GGUFError, match="corrupt.gguf"):
        load_model(bad)


def test_gguf_with_corrupt_tensor_type_names_tensor(default_gguf, tmp_path):
    # Flip the ggml type of the first tensor to an impossible value: the reader
    # must refuse the file rather than produce garbage weights.
    import gguf

    data = bytearray(default_gguf.read_bytes())
    reader = gguf.GGUFReader(default_gguf)
    field = reader.tensors[0].field
    type_offset = field.offset + sum(p.nbytes for p in field.parts[:4])
    data[type_offset:type_offset + 4] = (250).to_bytes(4, "little")
    bad = tmp_path / "badtype.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="badtype.gguf"):
        load_model(bad)


def _tiny_hf(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path / "model.safetensors"


def test_safetensors_wrong_shape_names_file_and_tensor(tmp_path):
    file = _tiny_hf(tmp_path)
    tensors = load_file(file)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = np.zeros((17, 32), np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(WeightError) as e:
        load_model(tmp_path)
    assert name in str(e.value) and "model.safetensors" in str(e.value)
    assert "(17, 32)" in str(e.value) and "expected (16, 32)" in str(e.value)


def test_safetensors_missing_tensor_is_named(tmp_path):
    file = _tiny_hf(tmp_path)
    tensors = load_file(file)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"missing tensor\(s\) model\.layers\.0\.mlp\.up_proj"):
        load_model(tmp_path)


def test_truncated_safetensors_names_file(tmp_path):
    file = _tiny_hf(tmp_path)
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(WeightError, match="model.safetensors"):
        load_model(tmp_path)


def test_sharded_index_with_missing_shard(tmp_path):
    _tiny_hf(tmp_path)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError, match="model-00002-of-00002.safetensors"):
        load_model(tmp_path)


def test_unknown_path_and_format(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(tmp_path)
