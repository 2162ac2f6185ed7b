"""The device side that concerns the process, not one runner: the store of compiled
executables, joining a multi-process run, and sizing the KV cache from device memory before
a runner is built. With the model runner, the only engine modules that touch jax.

The executable store keeps compiled step executables on disk and finds them again without
tracing the model.

XLA's persistent compilation cache is keyed by the lowered module, so a warm start still
traces and lowers every executable of the table before it can look one up: on the 2-core
CPU that was ~0.3 s an executable, most of a warm warmup. This store keys each executable
by what decides it instead, all known before tracing: the jax/jaxlib versions, the platform
and devices, XLA flags, the source of the packages that build the step (`engine`, `models`,
`ops`), the model's graph definition (its config and attention backend), the abstract
shapes, dtypes and shardings of the parameters and KV pages, the engine limits that shape
the step's inputs, and the bucket. A hit is a deserialization (~20 ms); anything unreadable
or stale is compiled afresh and rewritten.

What is stored must be a fresh compile: an executable that XLA's persistent cache handed
back serializes without some of its kernels on XLA:CPU (jax 0.10.2: "Function
copy_dot_fusion not found" when the reloaded copy runs), and jax offers no per-compile way
around that cache. So a process with this store leaves XLA's persistent cache off (see
`executable_store_dir`), and one where something else turned it on gets no store.

Loading runs code from the file (pickle), like XLA's own cache, so the store is private
(ops/cache_trust.py): its directories are created 0700 and its files 0600, and a file is
loaded only when it and every directory from the store's root down belong to this user and
no one else can write them. A refused file is a miss (warned once): compiled afresh and
replaced by a new private file when its directory passes, never written into; a refused
directory gets nothing written into it (a refused root turns the store off).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

from engine.config import EngineConfig
from models.known_models import user_cache_dir
from models.loader import load_config, resolve_dtype
from models.registry import param_specs
from models.sharding import sharded_config
from ops import cache_trust, native
from ops.attention import kv_token_bytes, resolve_kv_dtype

logger = logging.getLogger(__name__)


def executable_store_dir() -> str | None:
    """Where compiled step executables are kept between runs (ExecutableStore):
    $XLASERVE_COMPILE_CACHE, else the user cache, created private if missing; None when that
    variable is "off", in a multi-process run (each process compiles afresh there, see
    init_distributed), when XLA's own persistent cache was turned on by someone else (its
    executables do not survive a second serialization on CPU), or when the directory is not
    this user's alone or cannot be made (logged)."""
    setting = os.environ.get("XLASERVE_COMPILE_CACHE", "")
    if setting == "off" or _distributed or jax.config.jax_compilation_cache_dir:
        return None
    directory = setting or str(user_cache_dir() / "executables")
    try:
        cache_trust.private_dir(Path(directory))
    except OSError as e:  # UntrustedPath among them
        logger.warning("executable store off, every executable is compiled: %s", e)
        return None
    return directory


_distributed = False  # set by init_distributed


def init_distributed(coordinator_address: str, num_processes: int, process_id: int) -> int:
    """Join the multi-process JAX runtime (before any other jax call); returns the number
    of devices across all processes. CPU collectives go over gloo (GPUs and TPUs bring
    their own)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Without this a follower that dies takes process 0 down with it (the coordination
    # service terminates every task); with it process 0 lives to report the loss.
    try:
        jax.config.update("jax_enable_recoverability", True)
    except AttributeError:  # a jax without the flag: a dead follower then ends process 0
        logger.warning("this jax cannot survive a dead follower (no jax_enable_recoverability)")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    # Seen on CPU (jax 0.10.2): with the persistent compilation cache warm, process 0 with 2
    # devices and a follower with 1 hung in the first warmup step; with it off they did
    # not. Multi-process runs compile afresh.
    global _distributed
    _distributed = True
    logger.info("Process %d of %d: %d local and %d global devices", process_id, num_processes,
                jax.local_device_count(), jax.device_count())
    return jax.device_count()


# Without --num-pages, --kv-cache-memory-bytes or --gpu-memory-utilization, the KV pool holds
# every sequence at full length, but takes at most: on CPU this share of RAM (which the rest of
# the machine shares; requests beyond it wait for pages or are preempted, as with llama.cpp's
# -c), on an accelerator this fraction of its memory after the weights.
DEFAULT_CPU_KV_SHARE = 1 / 32
DEFAULT_ACCELERATOR_FRACTION = 0.9


def resident_bytes() -> int | None:
    """This process's resident memory (Linux), or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def compile_workers() -> int:
    """Executables the warmup compiles at once: two (XLA compiles one largely on one thread).
    Eight at a time on an H200's 16-core host did not shorten it: Llama-3-8B's 19 executables
    took 50.8 s, where an earlier run with two took 24.3 s (docs/performance.md)."""
    return min(2, os.cpu_count() or 1)


def device_memory_bytes() -> int:
    """Memory of one device: the accelerator's limit, or physical RAM on CPU."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def size_kv(config: EngineConfig, memory_fraction: float | None = None, num_models: int = 1,
            kv_memory_bytes: int | None = None) -> EngineConfig:
    """`config` with its KV budget settled (what the server and the bench start from). A
    share of device memory is left to the runner, which sizes the pool once it knows what the
    weights and its largest step take (`kv_pages` with `weight_bytes` and `step_bytes`): an
    explicit `memory_fraction`, split between the models served, goes in
    `gpu_memory_utilization`; the accelerator default of one model needs nothing more. The
    page count is set here for a byte budget, the CPU default, and from estimates where the
    runner cannot size alone (an accelerator default shared by several models, and
    multi-process runs, where every process must build the same pool)."""
    if config.num_blocks is not None:
        return config
    if kv_memory_bytes is None and not _distributed:
        if memory_fraction is not None:
            return dataclasses.replace(config,
                                       gpu_memory_utilization=memory_fraction / num_models)
        if jax.default_backend() != "cpu" and num_models == 1:
            return config
    return dataclasses.replace(config, num_blocks=kv_pages(config, memory_fraction, num_models,
                                                           kv_memory_bytes))


def sized_by_runner(config: EngineConfig) -> bool:
    """Whether the runner sizes `config`'s KV pool (see `size_kv`)."""
    return config.num_blocks is None and (config.gpu_memory_utilization is not None
                                          or jax.default_backend() != "cpu")


def kv_pages(config: EngineConfig, memory_fraction: float | None = None,
             num_models: int = 1, kv_memory_bytes: int | None = None, *,
             weight_bytes: float | None = None, step_bytes: int = 0,
             model_config=None) -> int:
    """KV pages (incl. the reserved page 0) for `config`. With `kv_memory_bytes`: what fits in
    that many bytes (per model). With a fraction (or `config.gpu_memory_utilization`): what
    fits in that share of device memory after the weights (`weight_bytes` per device, else
    estimated as float) and `step_bytes`, the temporary memory of the largest step
    (`model_config`: the model's shape when it is not read from `config.model`). Without
    either: enough for every sequence at full length, capped by the platform's default
    budget. Fewer pages than one `max_model_len` sequence needs is a startup error naming
    the budget."""
    if config.num_blocks is not None:
        return config.num_blocks
    memory_fraction = memory_fraction or config.gpu_memory_utilization
    cfg = model_config or load_config(config.model)  # the runner's own (random weights too)
    itemsize = np.dtype(resolve_dtype(config.dtype)).itemsize
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype))
    tp = config.tensor_parallel_size
    run_cfg = sharded_config(cfg, tp)  # fails here, at startup, if tp cannot split the model
    # Per device: a 1/tp share of the (nearly all split) weights and of every page's KV heads.
    weights = weight_bytes if weight_bytes is not None else (
        itemsize * sum(math.prod(s.shape) for s in param_specs(cfg).values()) / tp)
    page = (2 * cfg.num_layers * config.block_size * run_cfg.num_kv_heads // tp
            * kv_token_bytes(kv_dtype, cfg.head_dim))
    memory = device_memory_bytes()
    cpu = jax.default_backend() == "cpu"
    if cpu:
        memory /= tp  # (fake) CPU devices share one RAM
    if kv_memory_bytes is not None:
        budget = kv_memory_bytes / tp
        what = f"--kv-cache-memory-bytes ({kv_memory_bytes / 2**30:.2f} GiB)"
    elif memory_fraction is not None or not cpu:
        fraction = memory_fraction or DEFAULT_ACCELERATOR_FRACTION
        budget = fraction * memory / num_models - weights - step_bytes
        what = (f"{fraction:.0%} of device memory ({memory / 2**30:.1f} GiB) after "
                f"{weights / 2**30:.2f} GiB of weights and {step_bytes / 2**30:.2f} GiB for "
                f"the largest step")
    else:
        budget = DEFAULT_CPU_KV_SHARE * memory / num_models
        what = (f"the default KV budget, 1/{round(1 / DEFAULT_CPU_KV_SHARE)} of RAM "
                f"({budget / 2**30:.2f} GiB)")
    fit = max(int(budget // page), 0)
    explicit = kv_memory_bytes is not None or memory_fraction is not None
    pages = fit if explicit else min(fit, config.total_blocks)
    need = -(-config.max_model_len // config.block_size)
    if pages - 1 < need:
        raise ValueError(
            f"{config.model}: {what} holds {max(pages - 1, 0)} KV pages of "
            f"{config.block_size} tokens, fewer than one sequence of max_model_len "
            f"{config.max_model_len} needs ({need}): give the KV cache more memory "
            f"(--kv-cache-memory-bytes, --gpu-memory-utilization, --num-pages) or lower "
            f"--max-model-len")
    logger.info("KV cache for %s: %d pages of %d tokens (%d tokens, %.2f GiB in %s; budget: "
                "%s)", config.model, pages, config.block_size, pages * config.block_size,
                pages * page / 2**30, kv_dtype.name, what)
    return pages


# ---- the executable store -----------------------------------------------------------

_PACKAGES = ("engine", "models", "ops")
_ROOT = Path(__file__).resolve().parents[1]

MAX_CONFIGURATIONS = 32  # fingerprint directories kept; the least recently used go first

# EngineConfig fields that cannot change a compiled step (names, served limits, seeds).
# Config fields that change no executable (the KV pool's size, however it was chosen, is in the
# KV cache's shape, which the key holds).
_IRRELEVANT = {"model", "name", "max_waiting_requests", "seed", "enable_prefix_caching",
               "gpu_memory_utilization", "num_blocks",
               "async_scheduling", "load_format"}


def _code_digest() -> str:
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted([*(_ROOT / package).rglob("*.py"), *(_ROOT / package).rglob("*.cc")]):
            h.update(str(path.relative_to(_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _abstract(tree) -> str:
    leaves, treedef = jax.tree.flatten(tree)
    return repr(treedef) + repr([(x.shape, str(x.dtype), repr(getattr(x, "sharding", None)))
                                 for x in leaves])


def fingerprint(config, graphdef, state, kv) -> str:
    """The key shared by every executable of one runner (the bucket is added per file)."""
    devices = jax.devices()
    if jax.default_backend() == "cpu":
        native.available()  # loaded before its identity is read: one key in every process
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in _IRRELEVANT}
    parts = [
        jax.__version__, jaxlib.__version__, jax.default_backend(),
        repr([(d.platform, d.device_kind, d.id) for d in devices]),
        os.environ.get("XLA_FLAGS", ""), repr(jax.config.jax_enable_x64),
        repr(jax.config.jax_default_matmul_precision), _code_digest(), native.identity(),
        repr(graphdef),
        _abstract(state), _abstract(kv), repr(sorted(fields.items())),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


class ExecutableStore:
    def __init__(self, directory: str | Path, key: str, devices):
        """`directory`: the store's root, from which every file is checked (cache_trust);
        `devices`: those the executables run on (in mesh order), part of the key too."""
        self.devices = list(devices)
        ids = ",".join(str(d.id) for d in self.devices)
        self.root = Path(directory)
        self.name = hashlib.sha256(f"{key}:{ids}".encode()).hexdigest()[:32]
        self.directory = self.root / self.name
        self._refused: set[str] = set()  # what was warned about already

    def _path(self, bucket: tuple[str, int]) -> Path:
        kind, size = bucket
        return self.directory / f"{kind}-{size}.pkl"

    def _refuse(self, error: OSError) -> None:
        if str(error) not in self._refused:
            self._refused.add(str(error))
            logger.warning("executable store: %s; compiling without it", error)

    def _open(self, bucket: tuple[str, int]):
        """The stored file of `bucket` opened for reading once it passed the checks, else None
        (absent, or refused with a warning)."""
        try:
            return cache_trust.open_private(self.root, f"{self.name}/{self._path(bucket).name}")
        except FileNotFoundError:
            return None
        except OSError as e:  # UntrustedPath among them
            self._refuse(e)
            return None

    def has(self, bucket: tuple[str, int]) -> bool:
        """Whether `bucket` has a stored file that passes the checks (`load` may still find
        it unreadable)."""
        f = self._open(bucket)
        if f is not None:
            f.close()
        return f is not None

    def load(self, bucket: tuple[str, int]):
        """The stored executable of `bucket`, or None (absent, refused by the checks,
        unreadable, or made by a runtime that cannot load it)."""
        path = self._path(bucket)
        f = self._open(bucket)
        if f is None:
            return None
        try:
            with f:  # the very file checked, whatever its path names by now
                serialized, in_tree, out_tree = pickle.load(f)
            exe = serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, execution_devices=self.devices)
            os.utime(self.directory)  # recently used: kept by _prune
            return exe
        except Exception as e:  # a torn or foreign file: compile instead, and rewrite it
            logger.warning("ignoring stored executable %s (%s: %s)", path, type(e).__name__, e)
            return None

    def save(self, bucket: tuple[str, int], compiled) -> None:
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # e.g. a backend that cannot serialize: nothing to keep
            logger.info("cannot store executable %s (%s: %s)", bucket, type(e).__name__, e)
            return
        new = not self.directory.exists()
        try:  # nothing is written into a directory that is not this user's alone
            cache_trust.private_dir(self.root, self.name)
        except OSError as e:  # UntrustedPath among them
            self._refuse(e)
            return
        if new:
            self._prune()
        # Written whole (mkstemp: 0600), then renamed over whatever the name held (a refused
        # file too: its directory passed, and the rename never writes into it): a reader
        # never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(bucket))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _prune(self) -> None:
        """Keep the MAX_CONFIGURATIONS most recently used fingerprints: every source change
        or new engine configuration starts a directory, and nothing else removes them."""
        root = self.directory.parent
        entries = sorted((d for d in root.iterdir() if d.is_dir()),
                         key=lambda d: d.stat().st_mtime, reverse=True)
        for stale in entries[MAX_CONFIGURATIONS:]:
            shutil.rmtree(stale, ignore_errors=True)
