"""Smoothing before w8a8 (models/smoothing.py): the smoothed float model computes what the
original does in every family, the calibration reads every layer's inputs in order, and an
outlier channel costs int8 activations less once smoothed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import save_tiny_hf

from models import smoothing
from models.generate import GreedyDecoder
from models.loader import load_config, load_host_params
from models.weights import build_model, quant_plan, quantize_params

rng = np.random.default_rng(0)
CALIBRATION = [int(x) for x in rng.integers(1, 256, 48)]
PROMPT = [int(x) for x in rng.integers(1, 256, 20)]


def _logits(cfg, params, quant=None):
    model = build_model(cfg, params, jnp.float32, quant=quant)
    return GreedyDecoder(model, max_len=64).prompt_logits(PROMPT)


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# Llama's grouped KV heads and Gemma's (1 + w) norms by default; Qwen2's v bias and Qwen3's
# q/k norms under -m slow.
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("qwen3", marks=pytest.mark.slow), "gemma3"])
def test_smoothing_keeps_the_float_model(tmp_path, family):
    # Grouped KV heads (o's factors are shared across a group), Qwen2's v bias, Qwen3's q/k
    # norms, Gemma's (1 + w) norms.
    path = save_tiny_hf(tmp_path, family=family, num_key_value_heads=2)
    cfg = load_config(path)
    params, _ = load_host_params(path, cfg, jnp.float32, "none")
    smoothed = smoothing.smooth(params, cfg, CALIBRATION)
    for name in ("attn_norm", "mlp_norm", "wq", "wv", "wo", "w_up", "w_down"):
        assert not np.allclose(smoothed["layers"][name], params["layers"][name]), name
    assert _rel(_logits(cfg, smoothed), _logits(cfg, params)) < 1e-4


def test_calibration_reads_each_layer_in_order(tmp_path):
    path = save_tiny_hf(tmp_path, num_hidden_layers=3)
    cfg = load_config(path)
    params, _ = load_host_params(path, cfg, jnp.float32, "none")
    model = build_model(cfg, params, jnp.float32)
    compiled = smoothing._maxima(model, CALIBRATION)  # the step calls back, layer by layer
    with jax.disable_jit():
        eager = smoothing._maxima(model, CALIBRATION)
    assert set(compiled) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    for name, x in compiled.items():
        assert x.shape[0] == 3
        np.testing.assert_allclose(x, eager[name], rtol=1e-4)
    assert smoothing.RECORDING.get() is None


def test_an_outlier_channel_costs_less_once_smoothed(tmp_path):
    path = save_tiny_hf(tmp_path)
    cfg = load_config(path)
    params, _ = load_host_params(path, cfg, jnp.float32, "none")
    params["layers"]["attn_norm"][:, 7] *= 40.0  # q, k and v read one huge channel
    params["layers"]["wq"][:, :, 7] /= 40.0  # the same float model, nearly
    params["layers"]["wk"][:, :, 7] /= 40.0
    params["layers"]["wv"][:, :, 7] /= 40.0
    want = _logits(cfg, params)
    quant = quant_plan(cfg, "w8a8")
    plain = _rel(_logits(cfg, quantize_params(params, quant), quant), want)
    smoothed = _rel(_logits(cfg, quantize_params(smoothing.smooth(params, cfg, CALIBRATION),
                                                 quant), quant), want)
    assert smoothed < plain / 2, (smoothed, plain)
