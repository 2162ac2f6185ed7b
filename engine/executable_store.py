"""The executable store: compiled step executables on disk (`ExecutableStore`, under
`executable_store_dir()`), found again without tracing the model.

XLA's persistent compilation cache is keyed by the lowered module, so a warm start still
traces and lowers every executable of the table before it can look one up: on the 2-core
CPU that was most of a warm warmup (docs/performance-log.md, "Warm start and the lone decode").
This store keys each executable by what decides it instead, all known before tracing: the
jax/jaxlib versions, the platform and devices, XLA flags, the source of the packages that
build the step (`engine`, `models`, `ops`), the model's graph definition (its config and
attention backend), the abstract shapes, dtypes and shardings of the parameters and KV
pages, the engine limits that shape the step's inputs, and the bucket. A hit is a
deserialization, much cheaper than tracing and lowering (same section); anything unreadable
or stale is compiled afresh and rewritten.

A miss of that key (a new release, another configuration) lowers the step and looks for
its program in the program index (`PROGRAMS`: a digest of the lowered module without source
locations, its argument and result structure, the compile options, the runtime and devices,
as XLA's own cache keys it): a change of source that leaves the step's program alone, or a
configuration that shares a bucket's program with another, loads the executable compiled
for it (and keeps a copy under its own key) instead of compiling it again.

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

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
from jax.experimental import serialize_executable

from engine.distributed import is_distributed
from models.known_models import user_cache_dir
from ops import cache_trust, native

logger = logging.getLogger(__name__)


def executable_store_dir() -> str | None:
    """Where compiled step executables are kept between runs (ExecutableStore):
    $XLASERVE_COMPILE_CACHE, else the user cache, created private if missing; None when that
    variable is "off", in a multi-process run (each process compiles afresh there, see
    init_distributed), when XLA's own persistent cache was turned on by someone else (its
    executables do not survive a second serialization on CPU), or when the directory is not
    this user's alone or cannot be made (logged)."""
    setting = os.environ.get("XLASERVE_COMPILE_CACHE", "")
    if setting == "off" or is_distributed() or jax.config.jax_compilation_cache_dir:
        return None
    directory = setting or str(user_cache_dir() / "executables")
    try:
        cache_trust.private_dir(Path(directory))
    except OSError as e:  # UntrustedPath among them
        logger.warning("executable store off, every executable is compiled: %s", e)
        return None
    return directory


_PACKAGES = ("engine", "models", "ops")
_ROOT = Path(__file__).resolve().parents[1]

# The store's size on disk: past it, the least recently used configurations' directories go.
# One configuration of the default model on a CPU is 1-15 MB; a size, not a count, is what a
# user's disk notices.
MAX_BYTES = 4 << 30

# The program index: one file per program digest (ExecutableStore.program), holding the path
# below the root of the file last stored for it.
PROGRAMS = "programs"
LOCK = "compiling.lock"  # in each key's directory: ExecutableStore.compiling
_STORED = re.compile(r"[0-9a-f]{32}/[a-z0-9]+-[0-9]+\.pkl")

# EngineConfig fields that cannot change a compiled step (names, served limits, seeds).
# Config fields that change no executable (the KV pool's size, however it was chosen, is in the
# KV cache's shape, which the key holds).
_IRRELEVANT = {"model", "name", "max_waiting_requests", "seed", "enable_prefix_caching",
               "gpu_memory_utilization", "num_blocks",
               "async_scheduling", "load_format", "speculative",
               "cpu_kernels"}  # native.identity() in the key says which kernels ran


def _code_digest() -> str:
    """The source the executables are built from: engine, models and ops, but for the
    benchmarks (engine/bench), which compile nothing of their own into the store."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted([*(_ROOT / package).rglob("*.py"), *(_ROOT / package).rglob("*.cc")]):
            if path.is_relative_to(_ROOT / "engine" / "bench"):
                continue
            h.update(str(path.relative_to(_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _abstract(tree) -> str:
    leaves, treedef = jax.tree.flatten(tree)
    return repr(treedef) + repr([(x.shape, str(x.dtype), repr(getattr(x, "sharding", None)))
                                 for x in leaves])


def _runtime() -> list[str]:
    """What decides an executable besides its program: jax, XLA and its flags, the devices,
    our kernels' libraries (their names digest their sources)."""
    if jax.default_backend() == "cpu":
        for kernel in native.KERNELS:  # loaded before their identity is read: one key in
            native.available(kernel)    # every process
    return [
        jax.__version__, jaxlib.__version__, jax.default_backend(),
        repr([(d.platform, d.device_kind, d.id) for d in jax.devices()]),
        os.environ.get("XLA_FLAGS", ""), repr(jax.config.jax_enable_x64),
        repr(jax.config.jax_default_matmul_precision), native.identity(),
    ]


def fingerprint(config, graphdef, state, kv, dtype, kv_dtype) -> str:
    """The key shared by every executable of one runner (the bucket is added per file).
    `dtype`, `kv_dtype`: the compute and page dtypes the runner resolved config's to ("auto"
    and the dtype it chose compile the same steps, so they share them)."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in _IRRELEVANT}
    fields.update(dtype=str(jnp.dtype(dtype)), kv_cache_dtype=str(jnp.dtype(kv_dtype)),
                  # The task as run: a runner with pages generates ("auto" too), one without
                  # embeds (EmbeddingRunner), so the server and engine.bench share steps.
                  task="embed" if kv is None else "generate")
    parts = [*_runtime(), _code_digest(), repr(graphdef), _abstract(state), _abstract(kv),
             repr(sorted(fields.items()))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def load_or_compile(store: ExecutableStore | None, bucket: tuple[str, int], lower):
    """(executable, whether it came from `store`) of `bucket`: the one stored under the
    store's key; else the one stored for the same program under another key (another
    configuration or source that lowers to the same module), copied under this key; else
    compiled and stored. `lower()` -> (a jax `Lowered`, its compile options or None), called
    only on a miss of the key."""
    exe = None if store is None else store.load(bucket)
    if exe is not None:
        return exe, True
    lowered, options = lower()
    if store is None:
        return lowered.compile(options), False
    program = store.program(lowered, options)
    exe = store.load_program(program, bucket)
    if exe is not None:
        return exe, True
    exe = lowered.compile(options)
    store.save(bucket, exe, program)
    return exe, False


class ExecutableStore:
    def __init__(self, directory: str | Path, key: str, devices):
        """`directory`: the store's root, from which every file is checked (cache_trust);
        `devices`: those the executables run on (in mesh order), part of the key too."""
        self.devices = list(devices)
        ids = ",".join(str(d.id) for d in self.devices)
        self.root = Path(directory)
        self.name = hashlib.sha256(f"{key}:{ids}".encode()).hexdigest()[:32]
        self.device_ids = ids
        self.directory = self.root / self.name
        self._refused: set[str] = set()  # what was warned about already

    def _path(self, bucket: tuple[str, int]) -> Path:
        kind, size = bucket
        return self.directory / f"{kind}-{size}.pkl"

    def _refuse(self, error: OSError) -> None:
        if str(error) not in self._refused:
            self._refused.add(str(error))
            logger.warning("executable store: %s; compiling without it", error)

    def _open(self, relative: str):
        """root/relative opened for reading once it passed the checks, else None (absent, or
        refused with a warning)."""
        try:
            return cache_trust.open_private(self.root, relative)
        except FileNotFoundError:
            return None
        except OSError as e:  # UntrustedPath among them
            self._refuse(e)
            return None

    def _read(self, relative: str) -> bytes | None:
        f = self._open(relative)
        if f is None:
            return None
        with f:  # the very file checked, whatever its path names by now
            return f.read()

    def _relative(self, bucket: tuple[str, int]) -> str:
        return f"{self.name}/{self._path(bucket).name}"

    def has(self, bucket: tuple[str, int]) -> bool:
        """Whether `bucket` has a stored file that passes the checks (`load` may still find
        it unreadable)."""
        f = self._open(self._relative(bucket))
        if f is not None:
            f.close()
        return f is not None

    def load(self, bucket: tuple[str, int]):
        """The stored executable of `bucket`, or None (absent, refused by the checks,
        unreadable, or made by a runtime that cannot load it)."""
        exe = self._deserialize(self._read(self._relative(bucket)), self._path(bucket))
        if exe is not None:
            os.utime(self.directory)  # recently used: kept by _prune
        return exe

    def _deserialize(self, blob: bytes | None, path: Path):
        if blob is None:
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(blob)
            return serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, execution_devices=self.devices)
        except Exception as e:  # a torn or foreign file: compile instead, and rewrite it
            logger.warning("ignoring stored executable %s (%s: %s)", path, type(e).__name__, e)
            return None

    # ---- the same program under another key ----------------------------------------------

    def program(self, lowered, options: dict | None) -> str:
        """The digest of what a compile takes: the lowered module (its shapes, shardings and
        donations, without source locations), its argument and result structure, the compile
        options, the runtime and devices."""
        parts = [*_runtime(), self.device_ids, repr(sorted((options or {}).items())),
                 repr(lowered.in_tree), repr(lowered.out_tree), lowered.as_text()]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]

    def load_program(self, program: str, bucket: tuple[str, int]):
        """The executable compiled from `program` under another key (PROGRAMS indexes the file
        each program was last stored in), saved under this key too; None when there is none."""
        where = self._read(f"{PROGRAMS}/{program}")
        if where is None or not _STORED.fullmatch(where.decode("ascii", "replace")):
            return None
        blob = self._read(where.decode())
        exe = self._deserialize(blob, self.root / where.decode())
        if exe is not None:
            self._write(bucket, blob, program)
        return exe

    def save(self, bucket: tuple[str, int], compiled, program: str | None = None) -> None:
        """Store `compiled` under this key (and, with its `program`, in the program index)."""
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # e.g. a backend that cannot serialize: nothing to keep
            logger.info("cannot store executable %s (%s: %s)", bucket, type(e).__name__, e)
            return
        self._write(bucket, blob, program)

    def _make_directory(self, *others: str) -> bool:
        """This key's directory (and `others` below the root) made or found this user's
        alone; a new one first prunes the others (_prune). False, with a warning, when
        refused."""
        new = not self.directory.exists()
        try:  # nothing is written into a directory that is not this user's alone
            for name in (self.name, *others):
                cache_trust.private_dir(self.root, name)
        except OSError as e:  # UntrustedPath among them
            self._refuse(e)
            return False
        if new:
            self._prune()
        return True

    @contextlib.contextmanager
    def compiling(self):
        """Held while this process compiles executables for this key: a second process
        starting the same configuration (two servers at once, a restart) waits here, then
        finds them stored instead of compiling them too. An exclusive lock on a file in the
        key's directory, let go when the holder exits however it ends; where none can be
        taken, nothing is held (both compile, as without it)."""
        fd = None
        if self._make_directory():
            try:
                fd = os.open(self.directory / LOCK,
                             os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    logger.info("another process is compiling this configuration's "
                                "executables into the store; waiting for it")
                    fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                logger.info("compiling without the store's lock (%s)", e)
                if fd is not None:
                    os.close(fd)
                fd = None
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # the lock goes with the descriptor

    def _write(self, bucket: tuple[str, int], blob: bytes, program: str | None) -> None:
        if not self._make_directory(*([PROGRAMS] if program is not None else [])):
            return
        _write_whole(self._path(bucket), blob)
        if program is not None:  # the newest copy: the last to be pruned
            _write_whole(self.root / PROGRAMS / program, self._relative(bucket).encode())

    def _prune(self) -> None:
        """Keep the most recently used configurations within MAX_BYTES (this one always):
        every source change or new engine configuration starts a directory, and nothing else
        removes them."""
        root = self.directory.parent
        entries = sorted((d for d in root.iterdir()
                          if d.is_dir() and d != self.directory and d.name != PROGRAMS),
                         key=_mtime, reverse=True)
        total = _size(self.directory)
        for entry in entries:
            total += _size(entry)
            if total > MAX_BYTES:
                shutil.rmtree(entry, ignore_errors=True)
        for entry in (root / PROGRAMS).glob("*"):  # what points into removed directories
            try:
                if not (root / entry.read_text()).exists():
                    entry.unlink()
            except (OSError, UnicodeDecodeError):  # removed meanwhile, or not ours to read
                pass


def _write_whole(path: Path, blob: bytes) -> None:
    """Written whole (mkstemp: 0600), then renamed over whatever the name held (a refused
    file too: its directory passed, and the rename never writes into it): a reader never
    sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _mtime(directory: Path) -> float:
    try:
        return directory.stat().st_mtime
    except OSError:  # removed meanwhile by another process's prune
        return 0.0


def _size(directory: Path) -> int:
    try:
        return sum(f.stat().st_size for f in directory.iterdir())
    except OSError:  # removed meanwhile by another process's prune
        return 0
