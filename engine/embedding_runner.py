"""EmbeddingRunner: the device side of a pooling model (engine/embedding_engine.py).

Two kinds of model pool: an encoder (models/bert.py: bidirectional, no KV cache), and a
decoder under `--task embed`, whose final-normed hidden states are pooled (by default the
last token's, normalised, as vLLM does). Either way one executable per (rows, length)
bucket of `embed_buckets`, compiled (or loaded from the executable store) at warmup and run
once there on padding; after warmup nothing compiles. A batch's rows come packed one after
another into one token axis.

A decoder runs its ordinary paged body over a scratch KV pool made inside the executable
(a page run per row, never kept): its rows as one ragged prefill.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from engine.config import EngineConfig
from engine.embedding_engine import embed_buckets
from engine.executable_store import (
    ExecutableStore,
    executable_store_dir,
    fingerprint,
    load_or_compile,
)
from engine.step_table import compile_workers
from models.pooling import PoolingConfig, pool
from models.registry import model_kind
from ops import native
from ops.attention import AttentionMetadata
from ops.kv_cache import KVCache

logger = logging.getLogger(__name__)

# What a decoder's pooled output is when neither the model's files nor --pooling say:
# vLLM's default for a decoder turned embedder (the last token's state, normalised).
DECODER_POOLING = PoolingConfig(mode="last", normalize=True)


def pooling_for(config: EngineConfig, files: PoolingConfig) -> PoolingConfig:
    """The model's pooling (`files`) with the engine's --pooling/--normalize over it."""
    return PoolingConfig(mode=files.mode if config.pooling == "auto" else config.pooling,
                         normalize=files.normalize if config.normalize is None
                         else config.normalize)


def _decoder_embed(graphdef, params, tokens, lengths, *, block_size: int,
                   pooling: PoolingConfig):
    """A decoder's pooled final hidden states: tokens int32 [T] (rows packed one after
    another, padding after them), lengths int32 [S]."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    size, rows = tokens.shape[0], lengths.shape[0]
    pages_per_row = -(-min(size, cfg.max_position_embeddings) // block_size)
    starts = jnp.cumsum(lengths) - lengths  # [S] each row's first packed index
    at = jnp.arange(size, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(starts + lengths, at, side="right"), rows - 1)
    pos = at - starts[seq]
    valid = at < jnp.sum(lengths)
    # Row b's pages follow one another from a page of its own, after the pages of the rows
    # before it: the pool holds the step's tokens, not rows x the longest.
    num_pages = 2 + size // block_size + rows
    base = 1 + starts // block_size + jnp.arange(rows, dtype=jnp.int32)  # [S]
    page_tables = jnp.minimum(base[:, None] + jnp.arange(pages_per_row, dtype=jnp.int32)[None],
                              num_pages - 1)
    slots = page_tables[seq, jnp.clip(pos // block_size, 0, pages_per_row - 1)] * block_size
    md = AttentionMetadata(
        slot_mapping=jnp.where(valid, slots + pos % block_size, 0).astype(jnp.int32),
        query_start_loc=jnp.concatenate([starts, jnp.sum(lengths, keepdims=True)]).astype(
            jnp.int32),
        kv_lens=lengths, page_tables=page_tables,
        positions=jnp.where(valid, pos, 0).astype(jnp.int32),
        token_seq=jnp.where(valid, seq, -1).astype(jnp.int32))
    shape = (cfg.num_layers, num_pages, block_size, cfg.num_kv_heads, cfg.head_dim)
    kv = KVCache(jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))
    hidden, _ = model.hidden_states(tokens, md.positions, kv, md)  # [T, E]
    return pool(hidden, lengths, pooling)


def truncations(path: str, hidden_size: int) -> tuple[int, ...]:
    """The vector sizes a model was trained to be cut to (Matryoshka), from its config.json:
    `matryoshka_dimensions`, or any size under `is_matryoshka` (vLLM reads the same keys)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return ()
    hf = json.loads(config.read_text())
    if hf.get("matryoshka_dimensions"):
        return tuple(sorted(int(d) for d in hf["matryoshka_dimensions"] if 0 < d <= hidden_size))
    return tuple(range(1, hidden_size + 1)) if hf.get("is_matryoshka") else ()


class EmbeddingRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.tensor_parallel_size > 1 or config.speculative is not None:
            raise ValueError("an embedding model runs on one device, without speculative "
                             "decoding (--tensor-parallel-size 1, no --speculative-config)")
        if config.cpu_kernels != "auto":
            native.choose(config.cpu_kernels)
        start = time.perf_counter()
        if model_kind(config.model) == "encoder":
            from models import bert
            from models.loader import resolve_dtype

            encoder = bert.load_encoder(config.model, resolve_dtype(config.dtype))
            self.pooling = pooling_for(config, encoder.pooling)
            self.params, graph = encoder.params, (encoder.cfg, self.pooling)
            self._fn = functools.partial(bert.embed, cfg=encoder.cfg, pooling=self.pooling)
            tokenizer = encoder.tokenizer  # (it adds [CLS] ... [SEP] itself)
            self.encode = lambda text: tokenizer.encode(text).ids  # text -> token ids
            model_len = encoder.max_model_len
            self.vocab_size, self.hidden_size = encoder.cfg.vocab_size, encoder.cfg.hidden_size
        else:
            from models.loader import load_model
            from models.pooling import pooling_config
            from models.tokenizer import Tokenizer

            model = load_model(config.model, dtype=config.dtype,
                               attention_backend=config.attention_backend,
                               quantization=config.quantization, load_format=config.load_format)
            self.pooling = pooling_for(config, pooling_config(config.model, DECODER_POOLING))
            graphdef, self.params = nnx.split(model)
            graph = (graphdef, self.pooling, config.block_size)
            self._fn = functools.partial(_decoder_embed, graphdef, block_size=config.block_size,
                                         pooling=self.pooling)
            self.encode = Tokenizer.for_model(config.model).encode  # BOS by its rules
            model_len = model.cfg.max_position_embeddings or config.max_model_len
            self.vocab_size, self.hidden_size = model.cfg.vocab_size, model.cfg.hidden_size
        self.max_model_len = min(config.max_model_len, model_len)
        self.truncations = truncations(config.model, self.hidden_size)
        self.buckets = embed_buckets(config.max_num_seqs, config.max_num_batched_tokens,
                                     self.max_model_len)
        self.weight_bytes = sum(x.nbytes for x in jax.tree.leaves(self.params))
        store_dir = executable_store_dir()
        self.store = None if store_dir is None else ExecutableStore(
            store_dir, fingerprint(config, graph, self.params, None, jnp.float32, jnp.float32),
            jax.devices()[:1])
        self._executables: dict[tuple[int, int], object] = {}
        self.compilations_after_warmup = 0
        self.warm = False
        logger.info("%s: embeddings (%s pooling%s), %d dimensions, %.1f MiB of weights, "
                    "max_model_len %d, loaded in %.2fs; executables: (tokens, rows) %s",
                    config.name or config.model, self.pooling.mode,
                    ", normalised" if self.pooling.normalize else "", self.hidden_size,
                    self.weight_bytes / 2**20, self.max_model_len, time.perf_counter() - start,
                    list(self.buckets))

    def _compile(self, bucket: tuple[int, int]):
        size, rows = bucket
        ids = jax.ShapeDtypeStruct((size,), jnp.int32)
        lens = jax.ShapeDtypeStruct((rows,), jnp.int32)
        exe, _ = load_or_compile(self.store, (f"embed{rows}", size),
                                 lambda: (jax.jit(self._fn).lower(self.params, ids, lens), None))
        return exe

    def warmup(self) -> float:
        """Compile (or load) every bucket's executable and run each once on padding."""
        logger.info("Beginning dummy run.")
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(compile_workers()) as pool_:
            for bucket, exe in zip(self.buckets, pool_.map(self._compile, self.buckets),
                                   strict=True):
                self._executables[bucket] = exe
        for size, rows in self.buckets:
            self.run(np.zeros(size, np.int32), np.ones(rows, np.int32))
        self.warm = True
        elapsed = time.perf_counter() - start
        logger.info("Dummy run completed in %.2fs (%d executables).", elapsed, len(self.buckets))
        return elapsed

    def run(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Pooled vectors, float32 [S, hidden], of a bucket's batch: tokens [T] (the rows
        packed one after another, padding after them), lengths [S]."""
        bucket = (tokens.shape[0], lengths.shape[0])
        exe = self._executables.get(bucket)
        if exe is None:  # outside the table: a bug, counted (and compiled, so it answers)
            if self.warm:
                self.compilations_after_warmup += 1
                logger.warning("compiling embedding bucket %s after warmup", bucket)
            exe = self._executables[bucket] = self._compile(bucket)
        return np.asarray(exe(self.params, tokens, lengths))

    def release(self) -> None:
        self._executables.clear()
        self.params = None
