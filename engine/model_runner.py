"""ModelRunner: the engine's one device boundary (with engine/device.py, the only engine
modules importing jax).

It owns the parameters, the KV pages (donated into every step so they update in
place) and the table of compiled executables, all built at warmup: the model body once
per token bucket, the LM head + sampler once per sequence bucket (what each costs follows
what varies in it). `submit(batch)` dispatches a padded `StepBatch` to its body and head (the
hidden states stay on the device between them) and returns at once; the step's `result()`
brings back only the sampled token ids and their logprobs. Besides the KV pages, the
runner keeps per-slot state on the device (engine/batch.py's slots): each slot's last
sampled token, which the next step reads where the host has not learnt it yet (steps
overlap), and the penalty tables (output token counts, prompt ids). What concerns the
process rather than one runner (the executable store's place, multi-process start, sizing
the KV cache from device memory before a runner is built) lives in engine/device.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from engine import cluster, device
from engine.batch import (
    FLOAT_COLUMNS,
    StepBatch,
    body_layout,
    body_tokens,
    empty_batch,
    sampling_layout,
)
from engine.config import EngineConfig
from engine.grammar import mask_words
from models.llama import unrolls_layers
from models.loader import (
    describe_quant,
    load_config,
    load_model,
    release_host_memory,
    resolve_dtype,
    weight_bytes,
)
from models.progress import progress_bar
from models.sharding import kv_cache_sharding, make_mesh, replicated, sharded_config
from ops.attention import QUANTIZED_KV, AttentionMetadata, KVCache, kv_specs, resolve_kv_dtype
from ops.sampling import NUM_TOP_LOGPROBS, SamplingMetadata, count_sampled, reset_slot, sample

logger = logging.getLogger(__name__)

# Under --batch-invariant on CPU: XLA:CPU's fusion emitters choose a fused loop's code by the
# whole array's shape, so a row's values changed with what shared its step (a seeded request
# sampled other tokens beside other requests); its loop emitters compute every row alike.
# With them, and with our kernels and norms reducing each row in a fixed order, a row's
# logits are the same bits in any batch (docs/architecture.md, "Batch-invariant rows").
BATCH_INVARIANT_CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


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
    token_ids: np.ndarray     # [num_seqs] int32
    logprobs: np.ndarray      # [num_seqs] float32, raw logprob of each sampled token
    top_ids: np.ndarray       # [num_seqs, 20] int32
    top_logprobs: np.ndarray  # [num_seqs, 20] float32


def _pack(token_ids, logprobs, top_ids, top_logprobs) -> jax.Array:
    """A step's results as one [S, 2 + 2 * NUM_TOP_LOGPROBS] int32 array (floats bitcast): one
    transfer to the host per step rather than four."""
    bits = lambda a: jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
    return jnp.concatenate([token_ids.astype(jnp.int32)[:, None], bits(logprobs)[:, None],
                            top_ids.astype(jnp.int32), bits(top_logprobs)], axis=1)


class PendingStep:
    """A dispatched step; `result()` waits for it and brings its sampled tokens to the host."""

    def __init__(self, packed: jax.Array, num_seqs: int):
        self._packed, self._num_seqs = packed, num_seqs

    def result(self) -> StepResult:
        rows = np.asarray(self._packed)[:self._num_seqs]
        floats = rows.view(np.float32)
        return StepResult(rows[:, 0], floats[:, 1], rows[:, 2:2 + NUM_TOP_LOGPROBS],
                          floats[:, 2 + NUM_TOP_LOGPROBS:])


class BucketMiss(RuntimeError):
    """A step shape outside the warmed-up table: a bug, never silently compiled."""


class ModelRunner:
    def __init__(self, config: EngineConfig, model=None):
        self.config = config
        self.cluster = cluster.leader  # multi-host: followers mirror every device action
        if self.cluster is not None:
            if model is not None:
                raise ValueError("a multi-host runner loads its model from config.model")
            self.cluster.send("runner", config)
        store_dir = device.executable_store_dir()
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
        model.batch_invariant = config.batch_invariant
        model.unroll_layers = unrolls_layers(config.layer_loop, model.native_matmuls)
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
        held, as_float32 = weight_bytes(nnx.to_pure_dict(self.state))
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
        self.compilations_after_warmup = 0
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

    # ---- the compiled step: a body per token bucket, a head per sequence bucket ------------

    def _body(self, params, kv, last_tokens, buffer):
        layout = body_layout(self.config, body_tokens(self.config, buffer.shape[0]))
        inputs = {name: buffer[off:off + int(np.prod(shape))].reshape(shape)
                  for name, (off, shape) in layout.items()}
        slot = inputs["token_slot"]  # rows whose token is still on the device (overlap)
        tokens = jnp.where(slot >= 0, last_tokens[jnp.maximum(slot, 0)], inputs["tokens"])
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._params_tree, params))
        md = AttentionMetadata(
            slot_mapping=inputs["slot_mapping"], query_start_loc=inputs["query_start_loc"],
            kv_lens=inputs["kv_lens"], page_tables=inputs["page_tables"],
            positions=inputs["positions"], token_seq=inputs["token_seq"])
        return model.hidden_states(tokens, inputs["positions"], kv, md,
                                   inputs["logits_indices"])  # [max_num_seqs, E], kv

    def _head(self, params, hidden, output_counts, prompt_mask, last_tokens, ints, floats,
              token_mask):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._params_tree, params))
        num_seqs = ints.shape[1]
        columns = {name: floats[i] for i, name in enumerate(FLOAT_COLUMNS)}
        for name, (row, rows) in sampling_layout().items():
            columns[name] = ints[row] if rows == 1 else ints[row:row + rows].T
        columns["seeds"] = jax.lax.bitcast_convert_type(columns["seeds"], jnp.uint32)
        md = SamplingMetadata(**columns, output_counts=output_counts, prompt_mask=prompt_mask,
                              token_mask=token_mask)
        out = sample(model.logits(hidden[:num_seqs]), md)
        output_counts = count_sampled(output_counts, md.slots, out.token_ids)
        last_tokens = last_tokens.at[md.slots].set(out.token_ids)
        return (_pack(out.token_ids, out.logprobs, out.top_ids, out.top_logprobs),
                output_counts, last_tokens)

    def _step(self, params, kv, output_counts, prompt_mask, last_tokens, buffer, ints, floats,
              token_mask):
        """A small decode's body and head in one executable (EngineConfig.step_buckets)."""
        hidden, kv = self._body(params, kv, last_tokens, buffer)
        outputs, output_counts, last_tokens = self._head(
            params, hidden, output_counts, prompt_mask, last_tokens, ints, floats, token_mask)
        return outputs, kv, output_counts, last_tokens

    def step_bytes(self, store_dir: str | None = None) -> int:
        """Temporary device memory of the largest step, from XLA's memory analysis of the
        largest body and head compiled against a 2-page KV pool (what a step allocates
        besides the weights and the pages does not depend on their number; the probes are
        kept in the executable store like the steps)."""
        kv = jax.eval_shape(lambda: KVCache.zeros(*self._kv_shape(self.model_config, 2),
                                                  self.kv_dtype))
        if self.kv_shardings is not None:
            kv = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              kv, self.kv_shardings)
        store = self._store(store_dir, dataclasses.replace(self.config, num_blocks=2), kv)
        largest = 0
        for bucket in (("tokens", self.config.token_buckets[-1]),
                       ("seqs", self.config.seq_buckets[-1])):
            exe, _ = self._load_or_compile(store, bucket, kv)
            stats = exe.memory_analysis()
            if stats is None:  # a backend without the analysis: nothing to subtract
                logger.warning("no memory analysis for %s: the KV budget leaves no room for "
                               "the step's temporary memory", bucket)
                continue
            largest = max(largest, stats.temp_size_in_bytes)
        return largest

    def compile_bucket(self, bucket: tuple[str, int]):
        """One executable of the table, ("tokens", T) or ("seqs", S): loaded from the store
        when a runner of the same fingerprint compiled it before, else compiled ahead of time
        and stored."""
        exe, loaded = self._load_or_compile(self.store, bucket)
        self.num_stored_loads += loaded
        return exe

    def _store(self, store_dir: str | None, config: EngineConfig, kv):
        """The executable store of steps compiled for `config` against pages shaped as `kv`."""
        if store_dir is None:
            return None
        return device.ExecutableStore(
            store_dir, device.fingerprint(config, self.graphdef, self.state, kv),
            jax.devices()[:1] if self.mesh is None else self.mesh.devices.flat)

    def _load_or_compile(self, store, bucket: tuple[str, int], kv=None):
        """(executable, whether it came from `store`): compiled and stored when not there."""
        exe = None if store is None else store.load(bucket)
        if exe is not None:
            return exe, True
        exe = self._compile(bucket, kv)
        if store is not None:
            store.save(bucket, exe)
        return exe, False

    def _compile(self, bucket: tuple[str, int], kv=None):
        """`kv`: the pages (or their abstract shape) to compile the body against."""
        kind, size = bucket
        cfg = self.config
        counts, mask, last = self.slot_state
        if kind == "tokens":
            fn, donate = self._body, (1,)
            device_args = (self.params, self.kv if kv is None else kv, last)
            host_args = (empty_batch(cfg, (size, 1)).body,)
        elif kind == "seqs":
            hidden = np.zeros((cfg.max_num_seqs, self.model_config.hidden_size), self.dtype)
            fn, donate = self._head, (2, 4)
            device_args = (self.params,)
            batch = empty_batch(cfg, (1, size))
            host_args = (hidden, counts, mask, last, batch.sampling_ints, batch.sampling_floats,
                         np.zeros((size, mask_words(self.model_config.vocab_size)), np.int32))
        elif kind == "step":
            fn, donate = self._step, (1, 2, 4)
            device_args = (self.params, self.kv if kv is None else kv, counts, mask, last)
            batch = empty_batch(cfg, (size, size))
            host_args = (batch.body, batch.sampling_ints, batch.sampling_floats,
                         np.zeros((size, mask_words(self.model_config.vocab_size)), np.int32))
        elif kind == "penalties":
            fn, donate = reset_slot, (0, 1)
            device_args = (counts, mask)
            row = np.zeros(cfg.max_model_len, np.int32)
            host_args = (np.int32(0), row, row)
        else:
            raise ValueError(f"unknown bucket kind {kind!r}")
        if self.mesh is None:
            step = jax.jit(fn, donate_argnums=donate)
            abstract = lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype)
        else:  # host inputs and outputs replicated; pages stay split by KV head
            everywhere = replicated(self.mesh)
            outs = {"tokens": (everywhere, self.kv_shardings), "seqs": everywhere,
                    "step": (everywhere, self.kv_shardings, everywhere, everywhere),
                    "penalties": everywhere}[kind]
            step = jax.jit(fn, donate_argnums=donate, out_shardings=outs)
            abstract = lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=everywhere)
        options = (BATCH_INVARIANT_CPU_OPTIONS
                   if cfg.batch_invariant and jax.default_backend() == "cpu" else None)
        return step.lower(*device_args, *jax.tree.map(abstract, host_args)).compile(options)

    def warmup(self, progress=None) -> float:
        """Compile every executable of the table (several at a time: XLA's compiler is largely
        single-threaded; engine.device.compile_workers) and run each once on padding; returns
        seconds taken."""
        logger.info("Beginning dummy run.")
        rss_before = device.resident_bytes()
        start = time.perf_counter()
        loaded_before = self.num_stored_loads
        buckets = self.config.buckets()
        if self.compiles_in_child:
            missing = [b for b in buckets if not self.store.has(b)]
            if missing:
                self._compile_in_child(missing)
        bar = progress_bar(total=len(buckets), desc="Compiling", unit="executable")
        workers = 1 if self.cluster is not None else device.compile_workers()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(self.compile_bucket, b): b for b in buckets}
            for n, done in enumerate(concurrent.futures.as_completed(futures), 1):
                self._executables[futures[done]] = done.result()
                bar.update()
                if progress is not None:
                    progress(n, len(buckets), futures[done])
        compiled = time.perf_counter()
        # Each body with as many sequences as it holds: that runs every head too (each
        # sequence bucket is some body's body_seqs), and nothing twice; then the fused steps.
        for t in self.config.token_buckets:
            self.run(empty_batch(self.config, self.config.bucket_for(t, self.config.body_seqs(t))),
                     fuse=False)
        for n in self.config.step_buckets:
            self.run(empty_batch(self.config, (n, n)))
        spare = self.config.max_num_seqs
        self._reset_slots([(spare, np.zeros(0, np.int32), np.zeros(0, np.int32))])
        bar.close()
        self.warm = True
        release_host_memory()  # what loading, compiling and the runs on padding freed
        elapsed = time.perf_counter() - start
        loaded = self.num_stored_loads - loaded_before
        logger.info("Dummy run completed in %.2fs (%d executables in %.2fs: %d loaded from the "
                    "executable store, %d compiled; then each run once on padding).", elapsed,
                    len(buckets), compiled - start, loaded, len(buckets) - loaded)
        self._log_memory(rss_before)
        return elapsed

    def _compile_in_child(self, buckets: list[tuple[str, int]]) -> None:
        """Compile `buckets` into the executable store in a child process (engine/compile_child.py):
        what XLA's compiler allocates stays with the process that ran it (glibc keeps it:
        290-670 MiB of a first start's resident memory on the 2-core CPU), and a child's goes
        back when it exits. On any failure this process compiles them itself."""
        logger.info("Compiling %d executables in a child process.", len(buckets))
        start = time.perf_counter()
        fd, path = tempfile.mkstemp(suffix=".pkl")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump((self.config, buckets), f)
            proc = subprocess.run([sys.executable, "-m", "engine.compile_child", path],
                                  capture_output=True, text=True)
        finally:
            os.unlink(path)
        if proc.returncode != 0:
            logger.warning("compiling in a child process failed (exit %d); compiling here. "
                           "Its output ended with: %s", proc.returncode, proc.stderr[-2000:])
            return
        logger.info("The child compiled %d executables in %.2fs.", len(buckets),
                    time.perf_counter() - start)

    def _log_memory(self, rss_before_warmup: int | None) -> None:
        """The startup memory breakdown: what the process holds once ready, and of what."""
        rss = device.resident_bytes()
        mib = lambda b: b / 2**20
        tokens = self.config.total_blocks * self.config.block_size
        parts = (f"weights {mib(self.weight_bytes):.0f} MiB, KV pool {mib(self.kv_bytes()):.0f} "
                 f"MiB ({tokens} tokens in {self.kv_dtype.name})")
        if rss is None or self.mesh is not None or jax.devices()[0].platform != "cpu":
            logger.info("Memory on the device: %s", parts)  # host RSS says nothing of it
            return
        grown = rss - rss_before_warmup
        other = rss - self.weight_bytes - self.kv_bytes() - grown
        logger.info("Memory: %.0f MiB resident: %s, executables and warmup %.0f MiB (loaded "
                    "ones ~10 MiB each; what the compiler kept, where this process compiled), "
                    "everything else (Python, jaxlib, tokenizer) %.0f MiB",
                    mib(rss), parts, mib(grown), mib(other))

    def _executable(self, bucket: tuple[str, int]):
        exe = self._executables.get(bucket)
        if exe is None:
            if self.warm:
                self.compilations_after_warmup += 1
                raise BucketMiss(f"{bucket} is not in the warmed-up table of executables")
            exe = self._executables[bucket] = self.compile_bucket(bucket)
        return exe

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
        return PendingStep(outputs, batch.num_seqs)

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
