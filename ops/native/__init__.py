"""xlaserve's own CPU kernels (XLA FFI custom calls), built from source on first use.

Two kernels, each a source file here with its reasons in its header: `qmatmul.cc`, a
quantized matrix times a few rows of float32 activations (ops/quantization.linear says
when it runs), and `attention.cc`, ragged paged attention over the KV pool
(ops/cpu_attention.py). They are compiled together with the machine's C++ compiler for the
machine's own CPU (`-march=native`) into one library in the user cache, keyed by the
sources, the compiler, the CPU's features and jaxlib's FFI headers, then registered with
XLA. Where it cannot be built (no compiler, a CPU without AVX-512 VNNI) or is
turned off (`--native-kernels off`, `turn_off`; XLASERVE_NATIVE_KERNELS=0 makes that the
default), `available()` is False, the reason is logged
once, and the pure-XLA paths run instead (XLA's dot, the reference attention): same
results up to float summation order.

The library is code run as whoever loads it, under a name anyone can compute, so the cache
is private (ops/cache_trust.py): it is loaded only when it and every directory from the
`kernels` directory down are this user's alone, through the descriptor that was checked. A
refused library is rebuilt over its name when its directory passes; when the directory does
not, the library is built in a private temporary directory, loaded from there and removed.
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

from ops import cache_trust

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("qmatmul.cc", "attention.cc"))
QMATMUL = "xlaserve_qmatmul"  # the custom calls' names
ATTENTION = "xlaserve_attention"
_SYMBOLS = {QMATMUL: "XlaserveQMatmul", ATTENTION: "XlaserveAttention"}  # name -> handler
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")

_lock = threading.Lock()
_state: dict = {}  # "library": the loaded .so and "name" its file's, or "reason": why none


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
    return cache_trust.user_cache_dir() / "kernels"


def _build() -> tuple[ctypes.CDLL, Path]:
    """The library loaded, and its file: from the cache, built there first unless it
    holds it, or built in a private temporary directory when the cache is not this user's
    alone."""
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
    name = f"xlaserve-{key}.so"  # the same wherever it is built: it is in the store's key
    try:
        directory = cache_trust.private_dir(_cache_dir())
    except OSError as e:  # not this user's alone (UntrustedPath), or cannot be made
        logger.warning("the CPU kernels' cache is not used (%s): building them in a private "
                       "temporary directory", e)
        with tempfile.TemporaryDirectory(prefix="xlaserve-kernels-") as tmp:
            cache_trust.private_dir(Path(tmp))  # checked before building anything there
            _compile(cxx, include, Path(tmp, name))
            return _open(Path(tmp), name), Path(tmp, name)  # loaded: the file may go
    try:
        return _open(directory, name), directory / name
    except FileNotFoundError:
        pass
    except cache_trust.UntrustedPath as e:
        logger.warning("not loading the CPU kernels' library: %s; rebuilding it", e)
    _compile(cxx, include, directory / name)
    return _open(directory, name), directory / name


def _compile(cxx: list[str], include: str, out: Path) -> None:
    # Built beside its final name, made 0600 (dlopen needs no execute bit) and renamed over
    # whatever the name held: processes building at once never read a half-written library,
    # and a refused file is replaced, never written into.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cxx, *FLAGS, f"-I{include}", *map(str, SOURCES), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cxx)} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o600)  # the linker makes its output by the umask
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(directory: Path, name: str) -> ctypes.CDLL:
    """The library directory/name, dlopen'ed through the descriptor cache_trust checked (its
    /proc/self/fd name), so a path swapped after the check is never what is loaded. (dlopen
    hands back the library it loaded before under the same name, whatever the descriptor
    holds now: fine here, where a process loads one.)"""
    with cache_trust.open_private(directory, name) as f:
        by_fd = f"/proc/self/fd/{f.fileno()}"
        return ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(directory / name))


def available() -> bool:
    """Whether the kernels are built and registered with XLA (building them on first call)."""
    with _lock:
        if not _state:
            _state.update(_load())
        return "library" in _state


def turn_off(why: str) -> None:
    """Leave the kernels off in this process from now on (`--native-kernels off`): models
    loaded after this run XLA's matmuls and the reference attention, as with
    XLASERVE_NATIVE_KERNELS=0; a model loaded before keeps what it compiled."""
    with _lock:
        _state.clear()
        _state["reason"] = why


def reason() -> str | None:
    """Why the kernels are not available (None when they are)."""
    available()
    return _state.get("reason")


def identity() -> str:
    """What a compiled step's custom calls refer to: the loaded library's name, or "off"
    (builds nothing: a model that uses the kernel loaded it first)."""
    return _state["name"] if "library" in _state else "off"


def _load() -> dict:
    if os.environ.get("XLASERVE_NATIVE_KERNELS", "1") == "0":
        return {"reason": "XLASERVE_NATIVE_KERNELS=0"}
    if "cpu" not in {d.platform for d in jax.devices("cpu")}:
        return {"reason": "no CPU backend"}
    try:
        library, path = _build()
        for name, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("xlaserve's CPU kernels are off, XLA's matmuls run instead: %s", e)
        return {"reason": str(e)}
    logger.info("CPU kernels: %s", path)
    return {"library": library, "name": path.name}
