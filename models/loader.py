"""`load_model(path)`: one entry point for GGUF files, HF directories and Orbax checkpoints."""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import checkpoint
from models.config import ModelConfig
from models.gguf_loader import gguf_config, load_gguf_params
from models.hf_loader import load_hf_params
from models.llama import Llama
from models.sharding import param_shardings, repeat_kv_heads, sharded_config
from models.weights import build_model, pack_params, quant_plan, quantize_params
from ops.quantization import held_bytes
from ops.quantized_linear import held_formats
from ops.shard import TENSOR_AXIS

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def default_dtype() -> str:
    """float32 on CPU (exactness, speed of f32 matmuls there); bfloat16 on GPU/TPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def resolve_dtype(dtype: str | None):
    name = dtype or default_dtype()
    if name == "auto":
        name = default_dtype()
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose from {', '.join(DTYPES)} or auto")
    return DTYPES[name]


def model_format(path: str | Path) -> str:
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and checkpoint.is_checkpoint(path):
        return "orbax"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model file or directory")
    raise ValueError(f"{path}: not a GGUF file, an HF model directory (config.json + "
                     f"*.safetensors) or an xlaserve Orbax checkpoint")


def load_config(path: str | Path) -> ModelConfig:
    fmt = model_format(path)
    if fmt == "gguf":
        return gguf_config(path)
    if fmt == "orbax":
        return checkpoint.checkpoint_config(path)[0]
    return ModelConfig.from_hf_dir(path)


def load_host_params(path: str | Path, cfg: ModelConfig, dtype,
                     quantization: str | None = None) -> tuple[dict, dict]:
    """Parameters as host numpy arrays (GGUF and HF sources only), and the quantization
    plan they follow (models/weights.py quant_plan)."""
    fmt = model_format(path)
    if quantization == "w8a8" and fmt in ("gguf", "hf"):
        # Smoothed in float on a calibration text, then quantized (models/smoothing.py).
        from models.smoothing import CALIBRATION_TEXT, smooth
        from models.tokenizer import Tokenizer

        params, _ = load_host_params(path, cfg, dtype, "none")
        tokens = Tokenizer.for_model(path).encode(CALIBRATION_TEXT)
        quant = quant_plan(cfg, "w8a8")
        return quantize_params(smooth(params, cfg, tokens), quant), quant
    if fmt == "gguf":
        return load_gguf_params(path, cfg, dtype, quantization)
    if fmt == "hf":
        return load_hf_params(path, cfg, dtype, quantization)
    raise ValueError(f"{path}: host loading is for GGUF and HF sources, not {fmt}")


def load_model(path: str | Path, dtype: str | None = None,
               attention_backend: str = "reference", mesh=None,
               quantization: str | None = None, load_format: str = "auto") -> Llama:
    """Load weights from any supported source onto the default device, or with a
    tensor-parallel `mesh` straight into their shards (models/sharding.py). `quantization`
    (ops/quantization.py CHOICES; None: "none", every weight float): "auto" keeps a GGUF's
    quantized blocks (models/gguf_blocks.py), "int8"/"int4" quantize the matrices as they
    load; an Orbax checkpoint holds its own (scripts/convert.py --quantization) and takes no other.
    `load_format` "dummy": random weights of the model's shapes, made on the devices
    (benchmarks of a model whose weights are not at hand: its config is enough)."""
    jdtype = resolve_dtype(dtype)
    if load_format == "dummy":
        from models.weights import random_model

        return random_model(load_config(path), jdtype, attention_backend=attention_backend,
                            mesh=mesh, quantization=None if quantization == "auto"
                            else quantization)
    if load_format != "auto":
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    start = time.perf_counter()
    cfg = run_cfg = load_config(path)
    repeats = 1
    if mesh is not None:
        run_cfg = sharded_config(cfg, mesh.shape[TENSOR_AXIS])
        repeats = run_cfg.num_kv_heads // cfg.num_kv_heads
    if model_format(path) == "orbax":
        quant = checkpoint.checkpoint_quant(path)
        if quantization not in (None, "none", "auto") and not quant:
            raise ValueError(f"{path}: this checkpoint holds float weights; quantize it with "
                             f"scripts/convert.py --quantization {quantization}")
        shardings = None if mesh is None else param_shardings(cfg, mesh, quant)
        params = checkpoint.load_checkpoint_params(path, cfg, jdtype, shardings)  # on device
        if repeats > 1:  # from replicated KV heads to one (repeated) head per device
            repeat = functools.partial(repeat_kv_heads, repeats=repeats,
                                       head_dim=cfg.head_dim, xp=jnp)
            params = jax.jit(repeat, out_shardings=param_shardings(run_cfg, mesh, quant))(params)
    else:
        params, quant = load_host_params(path, cfg, jdtype, quantization)
        params = repeat_kv_heads(params, repeats, cfg.head_dim)
    held = held_formats(jdtype, quant, sharded=mesh is not None)  # 4-bit matrices two a byte
    if held != quant:
        on_device = model_format(path) == "orbax"
        params = pack_params(params, quant, held, xp=jnp if on_device else np)
        quant = held
    model = build_model(run_cfg, params, jdtype, attention_backend, mesh, quant)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    del params
    release_host_memory()
    logger.info("Loaded %s (%s, %s%s) in %.2fs", path, cfg.architecture,
                jnp.dtype(jdtype).name, describe_quant(quant), time.perf_counter() - start)
    return model


def release_host_memory() -> None:
    """Give the heap's free pages back to the system after loading (glibc keeps them):
    `w8a8` loads float weights and calibrates before quantizing, and without this the
    process kept a large part of those float weights' memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def describe_quant(quant: dict) -> str:
    """', weights int4 (group 32, with minimums) x 7, int8 (group 32)' or ''."""
    if not quant:
        return ""
    counts: dict[str, int] = {}
    for fmt in quant.values():
        counts[fmt.name] = counts.get(fmt.name, 0) + 1
    return ", weights " + ", ".join(f"{name} x {n}" for name, n in counts.items())


def weight_bytes(params, quant: dict) -> tuple[int, int]:
    """(bytes the parameters hold, bytes the same weights would hold in float32): what
    quantization saves, reported at startup. `quant`: the formats the parameters are held in
    (a packed one holds two values a byte: ops/quantization.pack)."""
    packed = {name for name, fmt in quant.items() if fmt.packed}
    held = as_float32 = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        held += held_bytes(leaf)
        name = ".".join(str(getattr(p, "key", p)) for p in path)
        if not name.endswith(("_scale", "_min")):
            as_float32 += leaf.size * (8 if name in packed else 4)
    return held, as_float32

