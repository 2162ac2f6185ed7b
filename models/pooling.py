"""Pooling: one embedding per sequence from a model's last hidden states.

Model-agnostic: an encoder's states (models/bert.py) or a causal decoder's are pooled the
same way. How a model pools comes from sentence-transformers' files beside its weights
(`modules.json`, the pooling module's `config.json`) when it has them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

MODES = ("mean", "cls", "last")

# sentence-transformers' pooling config: its older flags and its mode names -> ours.
_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
          "pooling_mode_lasttoken": "last"}
_ST_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    mode: str = "mean"      # "mean" | "cls" (position 0) | "last" (the last real token)
    normalize: bool = False  # L2-normalise the pooled vector

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"pooling mode must be one of {', '.join(MODES)}, got {self.mode!r}")


def pooling_config(path: str | Path, default: PoolingConfig = PoolingConfig()) -> PoolingConfig:
    """A model directory's pooling, from sentence-transformers' `modules.json` and its Pooling
    module's `config.json`; `default` for a directory (or a file) without them."""
    modules_file = Path(path) / "modules.json"
    if not modules_file.is_file():
        return default
    try:
        modules = json.loads(modules_file.read_text())
        types = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{modules_file}: not a sentence-transformers modules list ({e})") from e
    normalize = "Normalize" in types
    if "Pooling" not in types:
        return dataclasses.replace(default, normalize=normalize)
    config_file = Path(path) / types["Pooling"] / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: cannot read the pooling config ({e})") from e
    if "pooling_mode" in config:  # what newer sentence-transformers releases write
        named = config["pooling_mode"]
        modes = [named] if isinstance(named, str) else list(named)
    else:
        modes = [flag for flag, on in config.items() if flag.startswith("pooling_mode_") and on]
        modes = modes or ["mean"]  # what sentence-transformers does without a flag set
    ours = [_ST_MODES.get(m) or _FLAGS.get(m) for m in modes]
    if len(ours) != 1 or ours[0] is None:
        raise ValueError(f"{config_file}: unsupported pooling {', '.join(map(str, modes))} "
                         f"(supported: {', '.join(MODES)})")
    return PoolingConfig(ours[0], normalize)


def pool(hidden: jax.Array, lengths: jax.Array, cfg: PoolingConfig) -> jax.Array:
    """hidden [T, H]: the states of rows packed one after another from position 0 (row i's
    `lengths[i]` tokens right after row i-1's; padding after the last), lengths [S] int32 ->
    [S, H] float32. A row of length 0 (padding) gives a finite vector."""
    hidden = hidden.astype(jnp.float32)
    starts = jnp.cumsum(lengths) - lengths  # [S]
    if cfg.mode == "mean":
        row = jnp.arange(hidden.shape[0])
        member = ((row[None, :] >= starts[:, None])
                  & (row[None, :] < (starts + lengths)[:, None])).astype(jnp.float32)  # [S, T]
        total = jnp.einsum("ST,TH->SH", member, hidden)
        pooled = total / jnp.maximum(lengths, 1).astype(jnp.float32)[:, None]
    else:
        at = starts if cfg.mode == "cls" else starts + jnp.maximum(lengths - 1, 0)
        pooled = hidden[jnp.minimum(at, hidden.shape[0] - 1)]
    if cfg.normalize:
        # sentence-transformers' Normalize: x / max(|x|, 1e-12).
        norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
        pooled = pooled / jnp.maximum(norm, 1e-12)
    return pooled
