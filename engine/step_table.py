"""StepTable: ModelRunner's table of compiled executables, one per bucket, and what each
computes: the model body per token bucket, the LM head + sampler per sequence bucket, body
and head fused for a lone small decode, and the per-slot penalty reset. Each is compiled
ahead of time or loaded from the executable store (engine/executable_store.py); `warmup`
fills the table, on CPU through a child process (engine/compile_child.py), and runs every
entry once on padding.

ModelRunner (engine/model_runner.py) is a StepTable: the methods here read what its
__init__ sets (config, model_config, dtype, mesh, kv_shardings, graphdef, state, params, kv,
slot_state, cluster, store and the table's counters, weight_bytes, warm) and call its
`run`, `_reset_slots`, `_kv_shape` and `kv_bytes`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from engine import device
from engine.batch import body_layout, body_tokens, empty_batch, float_layout, sampling_layout
from engine.config import EngineConfig
from engine.executable_store import ExecutableStore, fingerprint, load_or_compile
from engine.grammar import mask_words
from models.loader import release_host_memory
from models.progress import progress_bar
from models.sharding import replicated
from ops.attention import AttentionMetadata
from ops.kv_cache import KVCache
from ops.sampling import count_sampled, reset_slot, sample
from ops.sampling_metadata import SamplingMetadata

logger = logging.getLogger(__name__)

# Under --batch-invariant on CPU: XLA:CPU's fusion emitters choose a fused loop's code by the
# whole array's shape, so a row's values changed with what shared its step (a seeded request
# sampled other tokens beside other requests); its loop emitters compute every row alike.
# With them, and with our kernels and norms reducing each row in a fixed order, a row's
# logits are the same bits in any batch (docs/architecture.md, "Batch-invariant rows").
BATCH_INVARIANT_CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
# Token buckets up to this are timed at warmup when speculative decoding is on (_time_steps):
# the steps it drafts in are small.
SPEC_TIMED_TOKENS = 64


def compile_workers() -> int:
    """Executables the warmup compiles at once: two (XLA compiles one largely on one thread).
    Eight at a time on an H200's 16-core host did not shorten it: Llama-3-8B's 19 executables
    took longer than in an earlier run with two (docs/performance-log.md, "The roofline issue's
    first GPU run: unrolled layers too slow to compile, int8 at 4.6 ms")."""
    return min(2, os.cpu_count() or 1)


class BucketMiss(RuntimeError):
    """A step shape outside the warmed-up table: a bug, never silently compiled."""


def _pack(token_ids, logprobs, top_ids, top_logprobs) -> jax.Array:
    """A step's results as one [S, 2 + 2 * NUM_TOP_LOGPROBS] int32 array (floats bitcast): one
    transfer to the host per step rather than four."""
    bits = lambda a: jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
    return jnp.concatenate([token_ids.astype(jnp.int32)[:, None], bits(logprobs)[:, None],
                            top_ids.astype(jnp.int32), bits(top_logprobs)], axis=1)


class StepTable:
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
        columns = {}
        for layout, buffer in ((sampling_layout(), ints), (float_layout(), floats)):
            for name, (row, rows) in layout.items():
                columns[name] = buffer[row] if rows == 1 else buffer[row:row + rows].T
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
        return ExecutableStore(
            store_dir, fingerprint(config, self.graphdef, self.state, kv, self.dtype,
                                   self.kv_dtype),
            jax.devices()[:1] if self.mesh is None else self.mesh.devices.flat)

    def _load_or_compile(self, store, bucket: tuple[str, int], kv=None):
        """(executable, whether it came from `store`): compiled and stored when not there."""
        return load_or_compile(store, bucket, lambda: self._lower(bucket, kv))

    def _lower(self, bucket: tuple[str, int], kv=None):
        """(the bucket's step lowered, its compile options); `kv`: the pages (or their
        abstract shape) to lower the body against."""
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
        return step.lower(*device_args, *jax.tree.map(abstract, host_args)), options

    def warmup(self, progress=None) -> float:
        """Compile every executable of the table (several at a time: XLA's compiler is largely
        single-threaded; compile_workers) and run each once on padding; returns seconds taken."""
        logger.info("Beginning dummy run.")
        rss_before = device.resident_bytes()
        start = time.perf_counter()
        loaded_before = self.num_stored_loads
        buckets = self.config.buckets()
        if self.compiles_in_child and any(not self.store.has(b) for b in buckets):
            with self.store.compiling():  # another process may be compiling them: wait
                missing = [b for b in buckets if not self.store.has(b)]
                if missing:
                    self._compile_in_child(missing)
        bar = progress_bar(total=len(buckets), desc="Compiling", unit="executable")
        workers = 1 if self.cluster is not None else compile_workers()
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
        if self.config.speculative is not None:
            self._time_steps()
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

    def _time_steps(self) -> None:
        """`step_seconds`: what a step of each token bucket up to SPEC_TIMED_TOKENS takes on
        padding (the best of two runs), as many head rows as tokens: the cost model of
        speculative decoding starts from these (engine/speculative.py)."""
        for t in self.config.token_buckets:
            if t > SPEC_TIMED_TOKENS:
                break
            self.step_seconds[t] = self.time_step(t)

    def time_step(self, num_tokens: int, num_seqs: int | None = None) -> float:
        """Seconds a step of `num_tokens` tokens (as many head rows, or `num_seqs`) takes on
        padding: the best of two runs."""
        t = num_tokens
        seqs = self.config.body_seqs(t) if num_seqs is None else num_seqs
        batch = empty_batch(self.config, self.config.bucket_for(t, seqs))
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            self.run(batch)  # fused where the table has the step (step_buckets)
            runs.append(time.perf_counter() - start)
        return min(runs)

    def _compile_in_child(self, buckets: list[tuple[str, int]]) -> None:
        """Compile `buckets` into the executable store in a child process (engine/compile_child.py):
        what XLA's compiler allocates stays with the process that ran it (glibc keeps it: a
        large part of a first start's resident memory on the 2-core CPU; docs/performance-log.md,
        "KV pages in float16 and a KV budget: the default server's memory"), and a child's
        goes back when it exits. On any failure this process compiles them itself."""
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
        logger.info("The child stored %d executables in %.2fs (compiled, or found by their "
                    "program).", len(buckets), time.perf_counter() - start)

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
