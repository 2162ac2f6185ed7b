"""Compiled step executables kept on disk, found again without tracing the model.

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
`ModelRunner`), and one where something else turned it on gets no store.

Loading runs code from the file (pickle), like XLA's own cache: keep the cache directory
private to its user.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import jax
import jaxlib
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

_PACKAGES = ("engine", "models", "ops")
_ROOT = Path(__file__).resolve().parents[1]

MAX_CONFIGURATIONS = 32  # fingerprint directories kept; the least recently used go first

# EngineConfig fields that cannot change a compiled step (names, served limits, seeds).
_IRRELEVANT = {"model", "name", "max_waiting_requests", "seed", "enable_prefix_caching"}


def _code_digest() -> str:
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((_ROOT / package).rglob("*.py")):
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
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in _IRRELEVANT}
    parts = [
        jax.__version__, jaxlib.__version__, jax.default_backend(),
        repr([(d.platform, d.device_kind, d.id) for d in devices]),
        os.environ.get("XLA_FLAGS", ""), repr(jax.config.jax_enable_x64),
        repr(jax.config.jax_default_matmul_precision), _code_digest(), repr(graphdef),
        _abstract(state), _abstract(kv), repr(sorted(fields.items())),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


class ExecutableStore:
    def __init__(self, directory: str | Path, key: str, devices):
        """`devices`: those the executables run on (in mesh order), part of the key too."""
        self.devices = list(devices)
        ids = ",".join(str(d.id) for d in self.devices)
        self.directory = Path(directory) / hashlib.sha256(f"{key}:{ids}".encode()).hexdigest()[:32]

    def _path(self, bucket: tuple[str, int]) -> Path:
        kind, size = bucket
        return self.directory / f"{kind}-{size}.pkl"

    def load(self, bucket: tuple[str, int]):
        """The stored executable of `bucket`, or None (absent, unreadable, or made by a
        runtime that cannot load it)."""
        path = self._path(bucket)
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f:
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
        if not self.directory.exists():
            self.directory.mkdir(parents=True)
            self._prune()
        # Written whole, then renamed: a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, self._path(bucket))

    def _prune(self) -> None:
        """Keep the MAX_CONFIGURATIONS most recently used fingerprints: every source change
        or new engine configuration starts a directory, and nothing else removes them."""
        root = self.directory.parent
        entries = sorted((d for d in root.iterdir() if d.is_dir()),
                         key=lambda d: d.stat().st_mtime, reverse=True)
        for stale in entries[MAX_CONFIGURATIONS:]:
            shutil.rmtree(stale, ignore_errors=True)
