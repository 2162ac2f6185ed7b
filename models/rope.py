"""Rotary position embeddings in the HF (rotate-half) layout, with Llama 3 or linear scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """[D/2] float32 inverse frequencies, computed on the host like HF does. `local`: those
    of the sliding-window layers when they have their own base (Gemma 3), never scaled."""
    d = cfg.head_dim
    local = local and cfg.rope_local_theta is not None
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    inv = inv.astype(np.float32)
    if local:
        return inv
    if cfg.rope_freq_factors is not None:  # llama.cpp's form of the same Llama 3 scaling
        return (inv / np.asarray(cfg.rope_freq_factors, np.float32)).astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return (inv / np.float32(s.factor)).astype(np.float32)
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x: [T, N, D], positions: [T]."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[:, None, :], jnp.sin(emb)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    return (xf * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
