"""xlaserve's own CPU kernels (XLA FFI custom calls), built from source on first use.

Two kernels, each a source file here with its reasons in its header: `qmatmul.cc`, a
quantized matrix times a few rows of float32 activations (ops/quantization.linear says
when it runs), and `attention.cc`, ragged paged attention over the KV pool
(ops/cpu_attention.py). They are compiled together with the machine's C++ compiler for the
machine's own CPU (`-march=native`) into one library in the user cache, keyed by the
sources, the compiler, the CPU's features and jaxlib's FFI headers, then registered with
XLA. Where it cannot be built (no compiler, a CPU without AVX-512 VNNI) or is
turned off (`XLASERVE_NATIVE_KERNELS=0`), `available()` is False, the reason is logged
once, and the pure-XLA paths run instead (XLA's dot, the reference attention): same
results up to float summation order.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("qmatmul.cc", "attention.cc"))
QMATMUL = "xlaserve_qmatmul"  # the custom calls' names
ATTENTION = "xlaserve_attention"
_SYMBOLS = {QMATMUL: "XlaserveQMatmul", ATTENTION: "XlaserveAttention"}  # name -> handler
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")

_lock = threading.Lock()
_state: dict = {}  # "library": the loaded .so, or "reason": why there is none


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> list[str] | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shlex.split(cxx)
    found = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return [found] if found else None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xlaserve" / "kernels"


def _build() -> Path:
    """The compiled library's path, building it unless the cache has it."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True)
    if version.returncode:
        raise RuntimeError(f"the C++ compiler {' '.join(cxx)!r} does not run")
    include = jax.ffi.include_dir()
    key = hashlib.sha256("\0".join([
        *(source.read_text() for source in SOURCES), " ".join(cxx), version.stdout,
        " ".join(FLAGS), _cpu_features(), include,
        *(p.read_text() for p in sorted(Path(include, "xla/ffi/api").glob("*.h"))),
    ]).encode()).hexdigest()[:24]
    out = _cache_dir() / f"xlaserve-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: processes building at once never read a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cxx, *FLAGS, f"-I{include}", *map(str, SOURCES), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cxx)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def available() -> bool:
    """Whether the kernels are built and registered with XLA (building them on first call)."""
    with _lock:
        if not _state:
            _state.update(_load())
        return "library" in _state


def reason() -> str | None:
    """Why the kernels are not available (None when they are)."""
    available()
    return _state.get("reason")


def identity() -> str:
    """What a compiled step's custom calls refer to: the loaded library's name, or "off"
    (builds nothing: a model that uses the kernel loaded it first)."""
    return Path(_state["library"]._name).name if "library" in _state else "off"


def _load() -> dict:
    if os.environ.get("XLASERVE_NATIVE_KERNELS", "1") == "0":
        return {"reason": "XLASERVE_NATIVE_KERNELS=0"}
    if "cpu" not in {d.platform for d in jax.devices("cpu")}:
        return {"reason": "no CPU backend"}
    try:
        path = _build()
        library = ctypes.CDLL(str(path))
        for name, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("xlaserve's CPU kernels are off, XLA's matmuls run instead: %s", e)
        return {"reason": str(e)}
    logger.info("CPU kernels: %s", path)
    return {"library": library}
