"""Tensor parallelism: one mesh axis and one table from logical axis names to it.

Parameters name their logical axes once, in `param_specs` (models/llama.py). `RULES` maps
those names to the mesh's tensor axis: attention heads, KV heads, MLP intermediate columns
and the vocabulary (when the size divides it) are split over it; everything else is
replicated. XLA's SPMD partitioner
then splits the matmuls and inserts the all-reduces (after the attention output projection
and the MLP down projection); attention itself runs per shard under `shard_map` (see
ops/shard.py), each device over its own heads and its own KV pages.

KV heads fewer than the tensor-parallel size N: each KV head is repeated N / num_kv_heads
times when the weights are loaded, so every device holds the one KV head its query heads
read (as in vLLM). The KV cache then has N heads; each device stores 1/N of it, and the
total is N / num_kv_heads times the unsharded cache.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.registry import param_specs
from ops.shard import TENSOR_AXIS

RULES: dict[str, str | None] = {
    "heads": TENSOR_AXIS,
    "kv_heads": TENSOR_AXIS,
    "mlp": TENSOR_AXIS,
    "vocab": TENSOR_AXIS,  # replicated instead when the size does not divide it
    "layers": None,
    "embed": None,
    "head_dim": None,
    "row_scale": None,  # a per-channel quantization scale's single column
}


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """A clear error, naming the model's numbers, when `size` cannot split this model."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {size}")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (neither divides the other)")
    if cfg.intermediate_size % size:
        problems.append(f"MLP intermediate size {cfg.intermediate_size}")
    if problems:
        raise ValueError(f"tensor parallel size {size} does not divide the model's "
                         f"{', '.join(problems)}")


def make_mesh(size: int, devices=None) -> Mesh:
    """A 1-D mesh over the first `size` devices (all processes' devices, in jax order)."""
    devices = jax.devices() if devices is None else devices
    if size > len(devices):
        raise ValueError(f"tensor parallel size {size} needs {size} devices; "
                         f"{len(devices)} available ({devices[0].platform})")
    return Mesh(np.asarray(devices[:size]), (TENSOR_AXIS,))


def kv_heads_for(cfg: ModelConfig, size: int) -> int:
    """KV heads after repetition so that every shard owns at least one."""
    return max(cfg.num_kv_heads, size)


def sharded_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config the sharded model runs with: KV heads repeated up to `size` if fewer."""
    check_tensor_parallel(cfg, size)
    return dataclasses.replace(cfg, num_kv_heads=kv_heads_for(cfg, size))


def repeat_kv_heads(params: dict, repeats: int, head_dim: int, xp=np) -> dict:
    """Repeat each KV head `repeats` times in wk/wv and their biases (and quantization
    scales): rows of head j of the result are those of head j // repeats of the input, which
    keeps query head h reading KV head h // (H / K) of the original model."""
    if repeats == 1:
        return params
    layers = dict(params["layers"])
    for name, x in params["layers"].items():
        if name.split("_")[0] in ("wk", "wv", "bk", "bv"):  # [L, K * D, ...]
            L, rows, *rest = x.shape
            heads = x.reshape(L, rows // head_dim, head_dim, *rest)
            layers[name] = xp.repeat(heads, repeats, axis=1).reshape(L, rows * repeats, *rest)
    return {**params, "layers": layers}


def param_shardings(cfg: ModelConfig, mesh: Mesh, quant: dict | None = None) -> dict:
    """Nested like the model's state: the NamedSharding of every parameter. KV heads too
    few to split (before `repeat_kv_heads`) are replicated."""
    from models.weights import nest  # models.weights places parameters with these

    size = mesh.shape[TENSOR_AXIS]
    rules = dict(RULES)
    if cfg.num_kv_heads % size:
        rules["kv_heads"] = None
    specs = param_specs(cfg, quant)
    if any(n % size for spec in specs.values() for n, a in zip(spec.shape, spec.axes, strict=True)
           if a == "vocab"):  # the vocabulary, or an int4 head's row blocks
        rules["vocab"] = None
    for name, spec in specs.items():
        if name.endswith(("_scale", "_min")) and spec.shape[-1] % size and rules[spec.axes[-1]]:
            raise ValueError(f"tensor parallel size {size} does not divide the "
                             f"{spec.shape[-1]} quantization groups of each row of "
                             f"{name.rsplit('_', 1)[0]}")
    return nest({name: NamedSharding(mesh, PartitionSpec(*(rules[a] for a in spec.axes)))
                 for name, spec in specs.items()})


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """KV pages [L, P, page, Hkv, D] split by KV head (KVCache.zeros splits int8 pages' scales
    the same way)."""
    return NamedSharding(mesh, PartitionSpec(None, None, None, TENSOR_AXIS, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
