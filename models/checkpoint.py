"""Orbax checkpoints written by `scripts/convert.py`: the fast way to reload a model.

Layout of a checkpoint directory:
  xlaserve.json   {"format": 2, "dtype": ..., "config": ModelConfig fields,
                   "quantization": {parameter: QuantFormat fields} (empty: float weights)}
  params/         Orbax StandardCheckpointer tree, nested like the model's state
  tokenizer files (tokenizer.json, tokenizer_config.json, ...)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from models.config import ModelConfig, RopeScaling
from models.weights import WeightError, abstract_model
from ops.quantization import QuantFormat

MARKER = "xlaserve.json"
FORMAT = 2  # 2: [out, in] matrices and quantized weights; 1 stored [in, out]


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_checkpoint(dst: str | Path, cfg: ModelConfig, params: dict, dtype,
                    quant: dict[str, QuantFormat] | None = None) -> None:
    dst = Path(dst).absolute()
    dst.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "dtype": jnp.dtype(dtype).name, "config": dataclasses.asdict(cfg),
            "quantization": {name: dataclasses.asdict(f) for name, f in (quant or {}).items()}}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(dst / "params", params, force=True)
    (dst / MARKER).write_text(json.dumps(meta, indent=2))  # last: marks a complete checkpoint


def _meta(path: str | Path) -> dict:
    file = Path(path) / MARKER
    meta = json.loads(file.read_text())
    if meta.get("format") == 1:
        raise WeightError(f"{file}: a checkpoint of an older xlaserve (format 1, [in, out] "
                          f"matrices); convert the model again with scripts/convert.py")
    if meta.get("format") != FORMAT:
        raise WeightError(f"{file}: unknown checkpoint format {meta.get('format')!r}")
    return meta


def checkpoint_quant(path: str | Path) -> dict[str, QuantFormat]:
    return {name: QuantFormat(**f) for name, f in _meta(path).get("quantization", {}).items()}


def checkpoint_config(path: str | Path) -> tuple[ModelConfig, str]:
    meta = _meta(path)
    fields = dict(meta["config"])
    if fields.get("rope_scaling"):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    for key in ("rope_freq_factors", "layer_types"):  # JSON lists back to tuples
        if fields.get(key):
            fields[key] = tuple(fields[key])
    return ModelConfig(**fields), meta["dtype"]


def load_checkpoint_params(path: str | Path, cfg: ModelConfig, dtype,
                           shardings: dict | None = None) -> dict:
    """Restore straight onto the device (or each parameter straight into its `shardings`,
    nested like the parameters), in `dtype`, with every shape checked by Orbax."""
    from flax import nnx

    abstract = nnx.to_pure_dict(nnx.state(abstract_model(cfg, dtype,
                                                         quant=checkpoint_quant(path))))
    if shardings is None:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: single, abstract)
    # The abstract model has every dtype: float weights in `dtype`, quantized parts as stored.
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
    params_dir = Path(path).absolute() / "params"
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(params_dir, target)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise WeightError(f"{params_dir}: checkpoint does not match the model config ({e})") from e
