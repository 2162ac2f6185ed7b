"""ModelRunner: the engine's one device boundary.

It owns the parameters, the KV pages (donated into every step so they update in
place) and the table of compiled executables (its base class, engine/step_table.py), all
built at warmup: the model body once per token bucket, the LM head + sampler once per
sequence bucket (what each costs follows what varies in it). `submit(batch)` dispatches a
padded `StepBatch` to its body and head (the hidden states stay on the device between them)
and returns at once; the step's `result()` brings back only the sampled token ids and their
logprobs. Besides the KV pages, the runner keeps per-slot state on the device
(engine/batch.py's slots): each slot's last sampled token, which the next step reads where
the host has not learnt it yet (steps overlap), and the penalty tables (output token counts,
prompt ids). What concerns the process rather than one runner lives beside it: sizing the KV
cache from device memory before a runner is built (engine/device.py), the executable store's
place (engine/executable_store.py), multi-process start (engine/distributed.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from engine import cluster, device
from engine.batch import StepBatch
from engine.config import EngineConfig
from engine.executable_store import executable_store_dir
from engine.grammar import mask_words
from engine.step_table import StepTable
from models.loader import (
    describe_quant,
    load_config,
    load_model,
    resolve_dtype,
    weight_bytes,
)
from models.run_options import set_run_options
from models.sharding import kv_cache_sharding, make_mesh, replicated, sharded_config
from ops import native
from ops.cpu_linear import FULL_X_BITS
from ops.kv_cache import QUANTIZED_KV, KVCache, kv_specs, resolve_kv_dtype
from ops.sampling_metadata import NUM_TOP_LOGPROBS

logger = logging.getLogger(__name__)

# Compilations are counted per runner: XLA reports each backend compile synchronously
# in the compiling thread, and a warm runner marks its thread while it runs a step.
_active = threading.local()
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _count_compile(event: str, duration: float, **kwargs) -> None:
    runner = getattr(_active, "runner", None)
    if event == _COMPILE_EVENT and runner is not None:
        runner.compilations_after_warmup += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@dataclasses.dataclass
class StepResult:
    token_ids: np.ndarray     # [num_rows] int32 (a head row per sequence, one more per draft)
    logprobs: np.ndarray      # [num_rows] float32, raw logprob of each sampled token
    top_ids: np.ndarray       # [num_rows, 20] int32
    top_logprobs: np.ndarray  # [num_rows, 20] float32


class PendingStep:
    """A dispatched step; `result()` waits for it and brings its sampled tokens to the host."""

    def __init__(self, packed: jax.Array, num_rows: int):
        self._packed, self._num_rows = packed, num_rows

    def result(self) -> StepResult:
        # Laid out by the head (engine/step_table.py's _pack): ids, logprob, top ids, top logprobs.
        rows = np.asarray(self._packed)[:self._num_rows]
        floats = rows.view(np.float32)
        return StepResult(rows[:, 0], floats[:, 1], rows[:, 2:2 + NUM_TOP_LOGPROBS],
                          floats[:, 2 + NUM_TOP_LOGPROBS:])


class ModelRunner(StepTable):
    def __init__(self, config: EngineConfig, model=None):
        self.config = config
        if config.cpu_kernels != "auto":  # before any model is loaded or step compiled
            native.choose(config.cpu_kernels)
        self.cluster = cluster.leader  # multi-host: followers mirror every device action
        if self.cluster is not None:
            if model is not None:
                raise ValueError("a multi-host runner loads its model from config.model")
            self.cluster.send("runner", config)
        store_dir = executable_store_dir()
        own_model = model is None
        kv = None
        # A share of device memory is sized here, once the weights are on the device and the
        # largest step's temporary memory is known (engine.device.size_kv).
        sized_here = device.sized_by_runner(config)
        if model is None:
            mesh = None
            if config.tensor_parallel_size > 1:
                mesh = make_mesh(config.tensor_parallel_size)
            if sized_here:
                model = load_model(config.model, dtype=config.dtype,
                                   attention_backend=config.attention_backend, mesh=mesh,
                                   quantization=config.quantization,
                                   load_format=config.load_format)
        if model is None:
            # Zeroing the KV pages (5.6 GiB at the CPU defaults: ~3 s) is memory-bound and
            # loading the weights is dequantization: one runs beside the other.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                kv = pool.submit(self._zero_kv, sharded_config(
                    load_config(config.model), config.tensor_parallel_size),
                    resolve_kv_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype)), mesh)
                model = load_model(config.model, dtype=config.dtype,
                                   attention_backend=config.attention_backend, mesh=mesh,
                                   quantization=config.quantization,
                                   load_format=config.load_format)
                kv = kv.result()
        self.mesh = model.mesh
        self.model_config = model.cfg  # with a mesh: KV heads repeated up to its size if fewer
        self.dtype = model.dtype
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        set_run_options(model, layer_loop=config.layer_loop,
                        batch_invariant=config.batch_invariant,
                        cpu_matmul_dtype=config.cpu_matmul_dtype,
                        cpu_activation_dtype=config.cpu_activation_dtype)
        self.graphdef, self.state = nnx.split(model)
        # Steps take the parameters as a flat list: a list flattens in the dispatcher's C++,
        # an nnx.State through Python callbacks, per leaf, at every call.
        self.params, self._params_tree = jax.tree.flatten(self.state)
        # How the pool splits by KV head under a mesh: pages, and int8 pages' scales.
        self.kv_shardings = None if self.mesh is None else jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            kv_specs(self.kv_dtype in QUANTIZED_KV), is_leaf=lambda x: isinstance(x, P))
        self.slot_state = self._zero_slot_state()
        self._no_masks: dict[int, jax.Array] = {}  # by sequence bucket (_no_token_mask)
        if sized_here:
            on_one_device = sum(x.addressable_shards[0].data.nbytes
                                for x in jax.tree.leaves(self.state))
            self.config = config = dataclasses.replace(config, num_blocks=device.kv_pages(
                config, weight_bytes=on_one_device, step_bytes=self.step_bytes(store_dir),
                model_config=self.model_config))
        if kv is None or (kv.k.shape, kv.k.dtype) != (self._kv_shape(self.model_config),
                                                      self.kv_dtype):
            kv = self._zero_kv(self.model_config, self.kv_dtype, self.mesh)
        self.kv = kv
        self._executables: dict[tuple[str, int], object] = {}
        self.store = self._store(store_dir, config, self.kv)
        self.num_stored_loads = 0  # executables deserialized from the store, not compiled
        # Warmup compiles in a child process where that returns the compiler's memory: on CPU
        # (elsewhere it would hold a second device), for a runner that loaded its own model
        # (a child can load it again) and stores executables (the child hands them over there).
        self.compiles_in_child = (self.store is not None and own_model and self.cluster is None
                                  and jax.default_backend() == "cpu")
        held, as_float32 = weight_bytes(nnx.to_pure_dict(self.state), dict(model.quant))
        self.weight_bytes = held
        logger.info(
            "%s: %s compute, %.1f MiB of weights (%.1f%% of float32)%s, %s attention, "
            "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, %d KV pages of %d "
            "tokens (%d tokens, %.2f GiB in %s); executables: a body per token count %s, a head "
            "per sequence count %s",
            config.name or config.model, np.dtype(self.dtype).name, held / 2**20,
            100 * held / as_float32, describe_quant(dict(model.quant)), model.attention_backend,
            config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
            config.total_blocks, config.block_size, config.total_blocks * config.block_size,
            self.kv_bytes() / 2**30, self.kv_dtype.name, list(config.token_buckets),
            list(config.seq_buckets))
        if jax.default_backend() == "cpu":
            logger.info("CPU kernels: %s", native.summary())
            if (model.quant and not native.available("qmatmul")
                    and not getattr(model, "int8_activations", False)):
                logger.warning(
                    "the quantized products run in XLA without the CPU kernel, several times "
                    "slower at one stream; --quantization w8a8 is XLA's fastest path on CPU "
                    "(the default model: 1.6x faster at one stream, 1.5x at 64) at some "
                    "accuracy (docs/models.md)")
            if (model.x_bits == FULL_X_BITS and native.multiplies_bound()
                    and any(fmt.packed for fmt in dict(model.quant).values())):
                logger.info(
                    "this CPU has AVX2 without VNNI, where the 4-bit products at one stream "
                    "may be bound by their multiplies: --cpu-activation-dtype int8 took 0.6x "
                    "their time on a Zen 1 EPYC, at 99% next-token agreement with the "
                    "default float32 activations (docs/serving.md)")
        self.compilations_after_warmup = 0
        self.step_seconds: dict[int, float] = {}  # token bucket -> seconds (_time_steps)
        self.warm = False

    def _no_token_mask(self, num_seqs: int) -> jax.Array:
        """The token mask of a step without grammars: zeros kept on the device, so that such a
        step transfers nothing for it (its `constrained` column is all 0)."""
        mask = self._no_masks.get(num_seqs)
        if mask is None:
            shape = (num_seqs, mask_words(self.model_config.vocab_size))
            # Made on the devices (a device_put of host zeros needs every device addressable).
            mask = self._no_masks[num_seqs] = jax.jit(
                lambda: jnp.zeros(shape, jnp.int32),
                out_shardings=None if self.mesh is None else replicated(self.mesh))()
        return mask

    def _kv_shape(self, cfg, num_pages: int | None = None) -> tuple[int, ...]:
        return (cfg.num_layers, num_pages or self.config.total_blocks, self.config.block_size,
                cfg.num_kv_heads, cfg.head_dim)

    def _zero_slot_state(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per slot (max_num_seqs + the spare): output token counts [N, V] i32, prompt ids
        [N, V] bool, last sampled token [N] i32."""
        n, vocab = self.config.max_num_seqs + 1, self.model_config.vocab_size
        # Made on the devices (a device_put of host zeros would compare them across processes).
        make = jax.jit(lambda: (jnp.zeros((n, vocab), jnp.int32), jnp.zeros((n, vocab), bool),
                                jnp.zeros((n,), jnp.int32)),
                       out_shardings=None if self.mesh is None else replicated(self.mesh))
        return make()

    def _zero_kv(self, cfg, dtype, mesh) -> KVCache:
        """Zeroed KV pages for model config `cfg`, split by KV head under a mesh."""
        return KVCache.zeros(*self._kv_shape(cfg), dtype,
                             None if mesh is None else kv_cache_sharding(mesh))

    def submit(self, batch: StepBatch, fuse: bool = True) -> PendingStep:
        """Dispatch one step without waiting for it (the device runs steps in order). A small
        decode without a grammar's mask runs as one executable (`fuse`: where the table has
        it), any other step as its body then its head."""
        num_tokens, num_seqs = batch.bucket
        fused = (fuse and num_tokens == num_seqs and batch.token_mask is None
                 and num_tokens in self.config.step_buckets)
        if fused:
            step = self._executable(("step", num_tokens))
        else:
            body = self._executable(("tokens", num_tokens))
            head = self._executable(("seqs", num_seqs))
        if self.cluster is not None:
            if batch.token_mask is not None:  # followers get the mask itself, not its maker
                batch = dataclasses.replace(
                    batch, token_mask=functools.partial(np.asarray, batch.token_mask()))
            self.cluster.send("run", (self.config.model, batch, fused))
        _active.runner = self if self.warm else None
        try:
            if batch.resets:
                self._reset_slots(batch.resets)
            counts, mask, last = self.slot_state
            if fused:
                outputs, self.kv, counts, last = step(
                    self.params, self.kv, counts, mask, last, batch.body, batch.sampling_ints,
                    batch.sampling_floats, self._no_token_mask(num_seqs))
            else:
                hidden, self.kv = body(self.params, self.kv, last, batch.body)
                # A grammar's mask is computed while the device runs the body.
                token_mask = (self._no_token_mask(num_seqs) if batch.token_mask is None
                              else batch.token_mask())
                outputs, counts, last = head(self.params, hidden, counts, mask, last,
                                             batch.sampling_ints, batch.sampling_floats,
                                             token_mask)
            self.slot_state = counts, mask, last
        finally:
            _active.runner = None
        return PendingStep(outputs, batch.num_rows)

    def run(self, batch: StepBatch, fuse: bool = True) -> StepResult:
        """One step, waited for."""
        return self.submit(batch, fuse).result()

    def _reset_slots(self, resets) -> None:
        reset = self._executable(("penalties", 1))
        width = self.config.max_model_len
        counts, mask, last = self.slot_state
        for slot, prompt, output in resets:
            rows = np.full((2, width), -1, np.int32)
            rows[0, :len(prompt)], rows[1, :len(output)] = prompt, output
            counts, mask = reset(counts, mask, np.int32(slot), rows[0], rows[1])
        self.slot_state = counts, mask, last

    def release(self) -> None:
        """Free this runner's device memory (weights, KV pages, executables) now rather than
        whenever the last reference goes: a rebooting engine calls it before building the
        next runner, so the two never hold device memory at once."""
        for x in jax.tree.leaves((self.state, self.kv, self.slot_state)):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        self._executables.clear()
        self.warm = False

    def kv_bytes(self) -> int:
        """Bytes of the KV pool (every page, and int8 pages' scales, on the device)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.kv))
