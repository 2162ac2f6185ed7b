"""xlaserve's own CPU kernels (XLA FFI custom calls), built from source on first use.

Two kernels, each a source file here with its reasons in its header: `qmatmul.cc`, a
quantized matrix times a few rows of float32 activations (ops/quantization.linear says
when it runs), and `attention.cc`, ragged paged attention over the KV pool
(ops/cpu_attention.py). Both are written in simd.h's vectors and compiled for one of its
targets, a *variant*: `avx512` (AVX-512 F/BW/VL, with VNNI's dot products where the CPU has
them), `avx2` (AVX2 + FMA + F16C, with AVX-VNNI where present), `neon` (AArch64, with the
dot-product extension where present) or `portable` (plain C++ for any other CPU). Each
kernel is its own library in the user cache, keyed by its sources, the compiler, the flags
and the CPU's features, built with the machine's C++ compiler and registered with XLA.

`--cpu-kernels` (`choose`; XLASERVE_CPU_KERNELS sets what `auto` means) picks them: `auto`
takes, per kernel, the first variant in VARIANTS that this CPU runs and that builds; a
variant's name forces it (a CPU without its features is a ValueError); `none` turns them off.
Where a kernel is not built (no compiler, a failed build, `none`), `available(kernel)` is
False, the reason is logged once, and XLA's paths run instead (XLA's dot, the reference
attention): the same results up to float summation order. A failed build is remembered
beside the library it would have been (`<name>.failed`, its reason inside), so later
processes neither retry it nor wait for it.

A library is code run as whoever loads it, under a name anyone can compute, so the cache
is private (ops/cache_trust.py): it is loaded only when it and every directory from the
`kernels` directory down are this user's alone, through the descriptor that was checked. A
refused library is rebuilt over its name when its directory passes; when the directory does
not, the library is built in a private temporary directory, loaded from there and removed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

from ops import cache_trust

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
KERNELS = ("qmatmul", "attention")
QMATMUL = "xlaserve_qmatmul"  # the custom calls' names
ATTENTION = "xlaserve_attention"
_TARGETS = {"qmatmul": (QMATMUL, "XlaserveQMatmul"),  # kernel -> (custom call, handler symbol)
            "attention": (ATTENTION, "XlaserveAttention")}
VARIANTS = ("avx512", "avx2", "neon", "portable")  # `auto`'s order of preference
CHOICES = ("auto", *VARIANTS, "none")  # --cpu-kernels
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off")

# variant -> (the CPU features it needs, {optional feature: the flags that use it}, flags)
_X86 = ("x86_64", "amd64")
_ARM = ("aarch64", "arm64")
_NEEDS = {
    "avx512": (("avx512f", "avx512bw", "avx512vl", "f16c", "fma"),
               {"avx512_vnni": ["-mavx512vnni"]},
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mf16c", "-mfma", "-mtune=native"]),
    "avx2": (("avx2", "fma", "f16c"), {"avx_vnni": ["-mavxvnni"]},
             ["-mavx2", "-mfma", "-mf16c", "-mtune=native"]),
    # every AArch64 CPU has Advanced SIMD (some kernels omit the flag); the last -march wins
    "neon": ((), {"asimddp": ["-march=armv8.2-a+dotprod"]}, ["-march=armv8-a"]),
    "portable": ((), {}, ["-march=native"]),
}

_lock = threading.Lock()
_setting: str | None = None  # what `choose` set; None: XLASERVE_CPU_KERNELS or auto
_state: dict[str, dict] = {}  # kernel -> {"library", "name", "variant"} or {"reason"}
_registered: dict[str, str] = {}  # custom call -> the library registered for it (once a process)


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (x86 `flags`, ARM `Features`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runs_here(variant: str, features: set[str] | None = None, machine: str | None = None) -> bool:
    """Whether this CPU (or one with `features` on `machine`) runs `variant`."""
    machine = (machine or platform.machine()).lower()
    features = cpu_features() if features is None else features
    arch = {"avx512": _X86, "avx2": _X86, "neon": _ARM}.get(variant)
    if arch is not None and machine not in arch:
        return False
    return set(_NEEDS[variant][0]) <= features


def compile_flags(variant: str, features: set[str] | None = None) -> list[str]:
    """The flags that build `variant` for a CPU with `features` (this one by default)."""
    features = cpu_features() if features is None else features
    _, optional, flags = _NEEDS[variant]
    extra = [f for feature, fs in optional.items() if feature in features for f in fs]
    return [*FLAGS, f"-DXLASERVE_{variant.upper()}", *flags, *extra]


def _compiler() -> list[str] | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shlex.split(cxx)
    found = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return [found] if found else None


def _cache_dir() -> Path:
    return cache_trust.user_cache_dir() / "kernels"


def _library_name(kernel: str, variant: str, cxx: list[str], version: str, flags: list[str]) -> str:
    include = jax.ffi.include_dir()
    key = hashlib.sha256("\0".join([
        (HERE / f"{kernel}.cc").read_text(), (HERE / "simd.h").read_text(), " ".join(cxx),
        version, " ".join(flags), " ".join(sorted(cpu_features())), include,
        *(p.read_text() for p in sorted(Path(include, "xla/ffi/api").glob("*.h"))),
    ]).encode()).hexdigest()[:24]
    # the same wherever it is built (it is in the executable store's key)
    return f"xlaserve-{kernel}-{variant}-{key}.so"


def _build(kernel: str, variant: str) -> tuple[ctypes.CDLL, Path]:
    """`kernel`'s `variant` loaded, and its file: from the cache, built there first unless it
    holds it (or remembers that the build failed), or built in a private temporary directory
    when the cache is not this user's alone."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True)
    if version.returncode:
        raise RuntimeError(f"the C++ compiler {' '.join(cxx)!r} does not run")
    flags = compile_flags(variant)
    name = _library_name(kernel, variant, cxx, version.stdout, flags)
    command = [*cxx, *flags, "-isystem", jax.ffi.include_dir(), str(HERE / f"{kernel}.cc")]
    try:
        directory = cache_trust.private_dir(_cache_dir())
    except OSError as e:  # not this user's alone (UntrustedPath), or cannot be made
        logger.warning("the CPU kernels' cache is not used (%s): building them in a private "
                       "temporary directory", e)
        with tempfile.TemporaryDirectory(prefix="xlaserve-kernels-") as tmp:
            cache_trust.private_dir(Path(tmp))  # checked before building anything there
            _compile(command, Path(tmp, name))
            return _open(Path(tmp), name), Path(tmp, name)  # loaded: the file may go
    failed = directory / f"{name}.failed"
    if failed.exists():
        raise RuntimeError(f"{failed.read_text().strip()} (an earlier build, remembered in "
                           f"{failed})")
    try:
        return _open(directory, name), directory / name
    except FileNotFoundError:
        pass
    except cache_trust.UntrustedPath as e:
        logger.warning("not loading the CPU kernels' library: %s; rebuilding it", e)
    try:
        _compile(command, directory / name)
    except RuntimeError as e:
        failed.write_text(f"{e}\n")
        raise
    return _open(directory, name), directory / name


def _compile(command: list[str], out: Path) -> None:
    # Built beside its final name, made 0600 (dlopen needs no execute bit) and renamed over
    # whatever the name held: processes building at once never read a half-written library,
    # and a refused file is replaced, never written into.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([*command, "-o", tmp], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{command[0]} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o600)  # the linker makes its output by the umask
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_held: list = []  # each loaded library's checked descriptor, open for the process's life


def _open(directory: Path, name: str) -> ctypes.CDLL:
    """The library directory/name, dlopen'ed through the descriptor cache_trust checked (its
    /proc/self/fd name), so a path swapped after the check is never what is loaded. The
    descriptor stays open: dlopen hands back the library it loaded before under the same
    name, so the next library must not reuse the number."""
    f = cache_trust.open_private(directory, name)
    by_fd = f"/proc/self/fd/{f.fileno()}"
    try:
        library = ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(directory / name))
    except OSError:
        f.close()
        raise
    _held.append(f)
    return library


def setting() -> str:
    """What --cpu-kernels asks for now: `choose`'s, else XLASERVE_CPU_KERNELS, else auto."""
    value = _setting or os.environ.get("XLASERVE_CPU_KERNELS", "auto")
    if value not in CHOICES:
        raise ValueError(f"XLASERVE_CPU_KERNELS must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def choose(value: str) -> None:
    """--cpu-kernels: `auto`, a variant, or `none`, for the models loaded from now on in this
    process (a model loaded before keeps what it compiled). A variant this CPU cannot run is
    a ValueError."""
    if value not in CHOICES:
        raise ValueError(f"--cpu-kernels must be one of {', '.join(CHOICES)}, got {value!r}")
    if value in VARIANTS and not runs_here(value):
        raise ValueError(f"--cpu-kernels {value}: this CPU ({platform.machine()}) lacks what it "
                         f"needs ({', '.join(_NEEDS[value][0]) or 'an AArch64 CPU'})")
    global _setting
    with _lock:
        if value != _setting:
            _state.clear()
        _setting = value


def available(kernel: str) -> bool:
    """Whether `kernel` (qmatmul or attention) is built and registered with XLA (building it
    on first call)."""
    with _lock:
        if kernel not in _state:
            _state[kernel] = _load(kernel)
        return "library" in _state[kernel]


def reason(kernel: str) -> str | None:
    """Why `kernel` is not available (None when it is)."""
    available(kernel)
    return _state[kernel].get("reason")


def variant(kernel: str) -> str | None:
    """The variant `kernel` runs as (None when it is not available)."""
    available(kernel)
    return _state[kernel].get("variant")


def multiplies_bound(kernel: str = "qmatmul") -> bool:
    """Whether `kernel` runs as the x86 AVX2 variant without 8-bit dot-product instructions
    (VNNI): there a lone decode's 4-bit products may be bound by their integer multiplies
    rather than by reading the weights. Measured on a Zen 1 EPYC only, where x in 8 bits
    (--cpu-activation-dtype int8) took ~0.6x their time (docs/performance-log.md, "8-bit
    activations for the 4-bit kernel")."""
    return variant(kernel) == "avx2" and "avx_vnni" not in cpu_features()


def multiplies_bytes(kernel: str = "qmatmul") -> bool:
    """Whether `kernel` runs as the AVX-512 variant with 8-bit dot products (VNNI), where its
    8-bit matrices in groups of 32 are held in its order and multiplied as integers
    (ops/quantized_linear.held_formats; qmatmul.cc's `Lanes8Tile`): the default model's 8-bit
    LM head at 4 rows took 0.81x the float product's time on a Zen 4 EPYC, 0.62x with x in 8
    bits (docs/performance-log.md, "The 8-bit head as integer dot products"). Elsewhere the
    float product stays: the other variants give the same bits but were not measured faster
    (AVX2's 16 registers hold one row's bytes, not their sign-flipped copies too)."""
    return variant(kernel) == "avx512" and "avx512_vnni" in cpu_features()


def multiplies_bfloat16(features: set[str] | None = None) -> bool:
    """Whether this CPU (or one with `features`) multiplies bfloat16 in its own instructions
    (`amx_bf16`: AMX's tiles, or `avx512_bf16`), where XLA's bfloat16 products of many rows
    run faster than float32's (ops.xla_linear.wide_dtype); elsewhere they are converted and
    run slower."""
    features = cpu_features() if features is None else features
    return "amx_bf16" in features or "avx512_bf16" in features


def library_name(kernel: str) -> str | None:
    """The file name of `kernel`'s loaded library (None when it is not available)."""
    available(kernel)
    return _state[kernel].get("name")


def identity() -> str:
    """What a compiled step's custom calls refer to: each loaded library's name, or "off"
    (builds nothing: a model that uses a kernel loaded it first)."""
    return ",".join(_state[k]["name"] if "library" in _state.get(k, {}) else "off" for k in KERNELS)


def summary() -> str:
    """One line for the start-up log: each kernel's variant (and the optional features it was
    built with), or why it is off."""
    parts = []
    for kernel in KERNELS:
        if available(kernel):
            extra = [f for f in _NEEDS[variant(kernel)][1] if f in cpu_features()]
            with_extra = f" (built with {', '.join(extra)})" if extra else ""
            parts.append(f"{kernel} {variant(kernel)}{with_extra}")
        else:
            parts.append(f"{kernel} off ({reason(kernel)})")
    return "; ".join(parts)


def _load(kernel: str) -> dict:
    value = setting()
    if value == "none":
        return {"reason": "--cpu-kernels none" if _setting else "XLASERVE_CPU_KERNELS=none"}
    if "cpu" not in {d.platform for d in jax.devices("cpu")}:
        return {"reason": "no CPU backend"}
    candidates = [v for v in VARIANTS if runs_here(v)] if value == "auto" else [value]
    reasons = []
    custom_call, symbol = _TARGETS[kernel]
    for v in candidates:
        try:
            library, path = _build(kernel, v)
            if _registered.setdefault(custom_call, path.name) != path.name:
                raise RuntimeError(f"{_registered[custom_call]} was registered in this "
                                   "process first")
            jax.ffi.register_ffi_target(custom_call, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            reasons.append(f"{v}: {e}")
            continue
        if reasons:
            logger.warning("xlaserve's CPU kernel %s runs as %s; %s", kernel, v, "; ".join(reasons))
        logger.info("CPU kernel %s: %s", kernel, path)
        return {"library": library, "name": path.name, "variant": v}
    why = "; ".join(reasons) or f"no variant runs on this CPU ({platform.machine()})"
    logger.warning("xlaserve's CPU kernel %s is off, XLA runs instead: %s", kernel, why)
    return {"reason": why}
