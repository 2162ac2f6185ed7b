"""How a built model runs, which whoever runs it decides before splitting it (the engine's
runner, `python -m models.parity`, `python -m models.generate`): its layer loop
(--layer-loop), batch-invariant rows (--batch-invariant) and the dtype of XLA's many-row
products on a CPU (--cpu-matmul-dtype) and the bits x keeps in our CPU kernel's 4-bit
products (--cpu-activation-dtype). Each is an attribute of the model that its trace
reads (models/llama.py); `set_run_options` is the one place that sets them."""

from __future__ import annotations

import jax

from ops.cpu_linear import X_BITS
from ops.xla_linear import wide_dtype

# The --layer-loop choices (engine.config.LAYER_LOOPS, held equal by a test).
LAYER_LOOPS = ("auto", "scan", "unroll", "scan-pallas")


def set_run_options(model, *, layer_loop: str = "auto", batch_invariant: bool = False,
                    cpu_matmul_dtype: str = "float32",
                    cpu_activation_dtype: str = "float32") -> None:
    """Set how `model` (a `models.llama.Llama` or a family of it) runs:

    - `layer_loop`: `unroll` unrolls the layers (not under the CPU kernel, whose quantized
      products take the stack and the layer index); `scan-pallas`, and `auto` on a GPU, loop
      over them and hand float and per-channel int8 matrices whole with the layer index to
      ops/pallas_gpu_matmul (one device); otherwise a plain loop (`unroll_layers`,
      `stacked_kernel`).
    - `batch_invariant`: our CPU kernels at every row count, and attention that never cuts a
      lone decode over the threads, so a row's numbers do not depend on its batch
      (docs/architecture.md, "Batch-invariant rows").
    - `cpu_matmul_dtype`: the dtype XLA's products of many rows multiply in on a CPU
      (ops.xla_linear.wide_dtype; `wide_dtype` None: the model's own).
    - `cpu_activation_dtype`: "int8" has ops/native's products with packed 4-bit weights
      take x in 8 bits per block of 32 (ops.cpu_linear.X_BITS), "float32" in 24."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, got {layer_loop!r}")
    model.unroll_layers = layer_loop == "unroll" and not model.native_matmuls
    model.stacked_kernel = model.mesh is None and (
        layer_loop == "scan-pallas" or (layer_loop == "auto" and jax.default_backend() == "gpu"))
    model.batch_invariant = batch_invariant
    model.wide_dtype = wide_dtype(model.dtype, cpu_matmul_dtype)
    if cpu_activation_dtype not in X_BITS:
        raise ValueError(f"cpu activation dtype must be one of {', '.join(X_BITS)}, "
                         f"got {cpu_activation_dtype!r}")
    model.x_bits = X_BITS[cpu_activation_dtype]
