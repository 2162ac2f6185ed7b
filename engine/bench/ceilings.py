"""What the machine and the model allow, for `python -m engine.bench` (and the serve bench's
optional ceilings): the matmul rate in the model's dtype and the copy bandwidth
(`measure_ceilings`), the rate the device reads memory (`read_bandwidth`), the model's
matmuls alone at a decode's row count (`dense_seconds`), and the weights a compiled step
copies before its products (`weight_copies`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_ceilings(dtype, m: int, k: int, n: int) -> dict:
    """Matmul rate at the model's [batch x hidden x intermediate] shape, and copy bandwidth."""
    a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
    mm = jax.jit(lambda a, b: a @ b)
    t = _best(lambda: mm(a, b).block_until_ready(), 30)
    x = jnp.ones((64 << 20,), jnp.float32)  # 256 MB
    cp = jax.jit(lambda x: x + 1)
    tc = _best(lambda: cp(x).block_until_ready(), 10)
    return {"matmul_flops_per_s": 2 * m * k * n / t, "matmul_shape": [m, k, n],
            "copy_bytes_per_s": 2 * x.nbytes / tc}


def read_bandwidth(nbytes: int) -> float:
    """Bytes a second the device reads: a sum over an `nbytes` float32 array (it reads the
    array and writes one number), the rate a decode's weight reads are held to."""
    x = jnp.arange(nbytes // 4, dtype=jnp.float32)
    total = jax.jit(jnp.sum)
    seconds = _best(lambda: total(x).block_until_ready(), 10)
    return x.nbytes / seconds


def weight_copies(runner: ModelRunner) -> dict[str, int]:
    """Instructions of each compiled one-row step that write a whole layer matrix (a weight
    copied or converted before its product; views and constant slices write nothing): 0
    when every product reads its weights in place. By executable, for those whose optimized
    program can be read."""
    from engine.bench.quantization import materialized
    from models.registry import param_specs

    num_layers = runner.model_config.num_layers
    shapes = {tuple(a.shape[1:]) for a in runner.params
              if a.ndim == 3 and a.shape[0] == num_layers and a.shape[1] * a.shape[2] >= 1 << 16}
    shapes |= {spec.shape[1:] for name, spec in param_specs(runner.model_config).items()
               if name.startswith("layers.") and len(spec.shape) == 3}
    found = {}
    for bucket in (("step", 1), ("tokens", 1)):
        executable = runner._executables.get(bucket)
        try:
            hlo = executable.as_text()
        except Exception:  # not compiled here (loaded), or no text from this backend
            continue
        found[f"{bucket[0]}{bucket[1]}"] = sum(materialized(hlo, o, i) for o, i in shapes)
    return found


def dense_seconds(runner: ModelRunner, num_tokens: int = 1, repeats: int = 30) -> float:
    """The model's matmuls alone for `num_tokens` rows (every layer's projections and MLP,
    then the LM head; no attention, no sampling): the floor a decode step's time is held to."""
    model = nnx.merge(runner.graphdef, runner.state)
    cfg = model.cfg
    layers = nnx.to_pure_dict(nnx.state(model.layers))
    head = model.head(model.top_params())

    @jax.jit
    def dense(layers, head, x):
        def layer(x, idx):
            p = model.layer_params(layers, idx)  # as the model reads its layers
            q, k, v = model.projects(x, p, ("wq", "wk", "wv"))
            x = x + model.project(q, p, "wo") + k.mean() + v.mean()
            gate, up = model.projects(x, p, ("w_gate", "w_up"))
            return x + model.project(jax.nn.silu(gate) * up, p, "w_down")

        x = model.over_layers(layer, x)  # scanned or unrolled, as the model runs them
        return model.logits(x, head)  # as the model runs its head

    x = jnp.ones((num_tokens, cfg.hidden_size), runner.dtype) * 0.01
    return _best(lambda: dense(layers, head, x).block_until_ready(), repeats)
