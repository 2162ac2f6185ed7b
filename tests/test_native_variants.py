"""Every variant of the CPU kernels (ops/native, simd.h's targets) on the same problems,
through a small C++ harness without XLA (tests/native_harness.cc): the x86 variants this CPU
runs are built and run here side by side (AVX-512 with and without VNNI, AVX2 with and
without AVX-VNNI, portable C++), and NEON (with and without the dot-product extension) is
cross-compiled and run under qemu-aarch64 where g++-aarch64-linux-gnu and qemu-user are
installed (`.ci/run` installs them; elsewhere the NEON tests skip and say why).

Each variant is held to the float64 references of the kernels' own tests, and every variant
gives the same bits as every other: simd.h defines each operation lane by lane, with one
order of summation, so only the instruction set differs."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import LAYER, make_case, oracle

from models.gguf_blocks import repack
from ops import cache_trust, native
from ops.kv_cache import KVCache
from ops.quantization import QuantFormat, pack, quantize, scheme_format, to_lanes8

HARNESS = Path(__file__).with_name("native_harness.cc")
T = gguf.GGMLQuantizationType
X86 = platform.machine().lower() in ("x86_64", "amd64")
CROSS, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
NO_NEON = (None if shutil.which(CROSS) and shutil.which(QEMU) else
           f"NEON variants need {CROSS} and {QEMU} (Debian: apt-get install g++-aarch64-linux-gnu "
           "qemu-user)")


def _features(variant: str, without: str | None) -> set[str]:
    if variant == "neon":
        return {"asimd"} | ({"asimddp"} if without != "asimddp" else set())
    return native.cpu_features() - {without}


# (variant, an optional feature left out) -> what stops it here, or None
BUILDS = {
    ("avx512", None): None, ("avx512", "avx512_vnni"): None,
    ("avx2", None): None, ("avx2", "avx_vnni"): None,
    ("portable", None): None,
    ("neon", None): NO_NEON, ("neon", "asimddp"): NO_NEON,
}
for (_v, _without) in BUILDS:
    if _v in ("avx512", "avx2") and not (X86 and native.runs_here(_v)):
        BUILDS[_v, _without] = f"this CPU does not run {_v}"
    elif _without and _v != "neon" and _without not in native.cpu_features():
        BUILDS[_v, _without] = f"this CPU has no {_without}: the build with it is the build without"
NAMES = {k: f"{k[0]}" + (f" without {k[1]}" if k[1] else "") for k in BUILDS}


@functools.cache
def _harness(variant: str, without: str | None, out_dir: str) -> list[str]:
    """The harness built as `variant` (without the optional feature `without`): the command
    that runs it. Kept in the user cache (private, as the kernels' libraries) under a name
    that digests the C++ sources, the flags and the compiler, so a run after a Python-only
    change does not build it again (the seven builds take ~45 s of a worker)."""
    flags = [f for f in native.compile_flags(variant, _features(variant, without))
             if f not in ("-shared", "-fPIC")]
    cxx = [CROSS, "-static"] if variant == "neon" else [shutil.which("c++") or "g++"]
    if variant == "neon":
        flags = [f for f in flags if f != "-mtune=native"]
    version = subprocess.run([cxx[0], "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(repr((cxx, flags, version)).encode())
    for source in [HARNESS, *sorted(HARNESS.parents[1].glob("ops/native/*.[ch]*"))]:
        digest.update(source.read_bytes())
    prefix = f"harness-{variant}-{without or 'all'}-"
    name = prefix + digest.hexdigest()[:24]
    try:
        directory = cache_trust.private_dir(cache_trust.user_cache_dir(), "test-harness")
        cache_trust.open_private(directory, name).close()  # there, and this user's alone
    except (OSError, cache_trust.UntrustedPath) as e:
        if not isinstance(e, FileNotFoundError):
            directory = Path(out_dir)  # an untrusted cache: build privately for this run
        fd, tmp = tempfile.mkstemp(dir=directory)  # renamed over the name when whole
        os.close(fd)
        done = subprocess.run([*cxx, *flags, str(HARNESS), "-o", tmp], capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        os.chmod(tmp, 0o700)
        os.replace(tmp, directory / name)
        for old in directory.glob(prefix + "*"):  # builds of older sources
            if old.name != name:
                old.unlink(missing_ok=True)
    exe = str(directory / name)
    return [QEMU, "-cpu", "max", exe] if variant == "neon" else [exe]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("harness"))

    def run(build, kernel: str, problem: bytes) -> bytes:
        done = subprocess.run([*_harness(*build, out), kernel], input=problem,
                              capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        return done.stdout
    return run


def _ints(*values) -> bytes:
    return np.asarray(values, np.int64).tobytes()


# ---- qmatmul --------------------------------------------------------------------------

def _gguf(tensor_type):
    return lambda w: repack(gguf.quants.quantize(w, tensor_type).reshape(-1), tensor_type, w.shape)


PACKED, LANES8 = 1, 2  # the harness's kinds of values but int8's (0)
FORMATS = {  # name -> (quantize a float32 [O, I] matrix, kind)
    "Q4_1 packed": (_gguf(T.Q4_1), PACKED), "Q4_0 packed": (_gguf(T.Q4_0), PACKED),
    "int4 group 128 packed": (lambda w: quantize(w, QuantFormat(4, 128)), PACKED),
    "Q4_1": (_gguf(T.Q4_1), 0), "Q8_0": (_gguf(T.Q8_0), 0),
    "int8 per channel": (lambda w: quantize(w, scheme_format("int8")), 0),
    "int8 group 16 with minimums": (lambda w: quantize(w, QuantFormat(8, 16, has_min=True)), 0),
    # 8-bit values in the kernel's order, plus 128 (ops/quantization.to_lanes8)
    "Q8_0 lanes8": (_gguf(T.Q8_0), LANES8),
    "int8 group 64 lanes8": (lambda w: quantize(w, QuantFormat(8, 64)), LANES8),
}


def _matrix(fmt: str, rows: int, cols: int, seed: int):
    """(the harness's bytes of one matrix, its shape ints, its float64 weight)."""
    make, kind = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * rng.uniform(0.1, 2, (rows, 1))
    m = make(w.astype(np.float32))
    q, scale = np.asarray(m["q"]), np.asarray(m["scale"], np.float16)
    minimum = np.asarray(m["min"], np.float16) if "min" in m else None
    group = cols // scale.shape[1]
    w = np.repeat(scale.astype(np.float64), group, axis=1) * q
    if minimum is not None:
        w += np.repeat(minimum.astype(np.float64), group, axis=1)
    values = {0: q.astype(np.int8), PACKED: pack(q, minimum is None, lanes=True),
              LANES8: to_lanes8(q)}[kind]
    data = values.tobytes() + scale.tobytes() + (minimum.tobytes() if minimum is not None else b"")
    return data, (kind, int(minimum is not None), rows, scale.shape[1]), w


def _qmatmul_problem(x: np.ndarray, mats, threads: int, x_bits: int) -> bytes:
    return (_ints(*x.shape, len(mats), threads, x_bits) + b"".join(_ints(*m[1]) for m in mats)
            + x.astype(np.float32).tobytes() + b"".join(m[0] for m in mats))


def _qmatmul(run, build, x, mats, threads=2, x_bits=24) -> list[np.ndarray]:
    out = np.frombuffer(run(build, "qmatmul", _qmatmul_problem(x, mats, threads, x_bits)),
                        np.float32)
    ys, at = [], 0
    for m in mats:
        n = x.shape[0] * m[1][2]
        ys.append(out[at:at + n].reshape(x.shape[0], m[1][2]))
        at += n
    assert at == out.size
    return ys


def _x_in_8_bits(x: np.ndarray) -> np.ndarray:
    """x as the packed kernel holds it with x_bits 8, in float64: each block of 32 of a row
    round(x / s) * s, s = the block's largest |x| / 127 (the float32 operations of
    qmatmul.cc's `Prepare`, rounded to nearest even)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    top = np.abs(blocks).max(axis=2, keepdims=True)
    scale = top / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, np.float32(127) / top, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv), -127, 127)
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(x.shape)


# 200 rows: not a multiple of 32; 608 columns: 19 blocks, so a packed row ends on a partial
# quad of blocks after a whole group of 16 (groups of 64 and 128: 640 columns, 20 blocks: a
# whole quad after the group). The formats in the kernel's order again with x in 8 bits
# (--cpu-activation-dtype int8).
QCASES = ([(fmt, 640 if "128" in fmt or "64" in fmt else 608, 24) for fmt in FORMATS]
          + [(fmt, 640 if "128" in fmt or "64" in fmt else 608, 8) for fmt in FORMATS
             if FORMATS[fmt][1]])


@pytest.fixture(scope="module")
def qmatmul_outputs(run):
    """For each case: x [13, I], the references (x as the kernel holds it, and x itself),
    and each build's outputs for all 13 rows at once (packed weights in tiles of 8 and 5 rows,
    or 4, 4, 4, 1 where two columns go at once; others 4, 4, 4, 1), for rows 0-4, 0-6, 7-12
    and 5 alone."""
    results = {}
    for i, (fmt, cols, x_bits) in enumerate(QCASES):
        mats = [_matrix(fmt, 200, cols, seed=10 * i), _matrix(fmt, 73, cols, seed=10 * i + 1)]
        x = np.random.default_rng(i).standard_normal((13, cols)).astype(np.float32)
        held = x.astype(np.float64) if x_bits == 24 else _x_in_8_bits(x)
        want = [(held @ m[2].T, x.astype(np.float64) @ m[2].T) for m in mats]
        got = {}
        for build, why in BUILDS.items():
            if why is None:
                got[build] = {"all": _qmatmul(run, build, x, mats, x_bits=x_bits),
                              "first five": _qmatmul(run, build, x[:5], mats, 1, x_bits),
                              "first seven": _qmatmul(run, build, x[:7], mats, x_bits=x_bits),
                              "last six": _qmatmul(run, build, x[7:], mats, x_bits=x_bits),
                              "sixth": _qmatmul(run, build, x[5:6], mats, x_bits=x_bits)}
        results[f"{fmt}, x in {x_bits} bits"] = (want, got)
    return results


@pytest.mark.parametrize("build", list(BUILDS), ids=[NAMES[b] for b in BUILDS])
def test_qmatmul_matches_float64_in_every_variant(build, qmatmul_outputs):
    """Each product is float64's of x as the kernel holds it (24 bits a block: float32's
    precision; 8 bits) up to float32's rounding, and 8 bits stay within Q8's error of x's."""
    if BUILDS[build]:
        pytest.skip(BUILDS[build])
    for case, (want, got) in qmatmul_outputs.items():
        for y, (held, exact) in zip(got[build]["all"], want, strict=True):
            err = np.abs(y - held).max() / np.abs(held).max()
            assert err < 2e-6, (case, err)
            err = np.abs(y - exact).max() / np.abs(exact).max()
            assert err < (2e-6 if "24 bits" in case else 2e-2), (case, err)


@pytest.mark.parametrize("build", list(BUILDS), ids=[NAMES[b] for b in BUILDS])
def test_qmatmul_rows_and_variants_give_the_same_bits(build, qmatmul_outputs):
    """A row's product alone, in a tile of 1-8 rows or beside 12 others, is the same bits; and
    the same bits as the first variant built here."""
    if BUILDS[build]:
        pytest.skip(BUILDS[build])
    for fmt, (_, got) in qmatmul_outputs.items():
        mine, first = got[build], next(iter(got.values()))
        for m in range(2):
            assert mine["first five"][m].tobytes() == mine["all"][m][:5].tobytes(), fmt
            assert mine["first seven"][m].tobytes() == mine["all"][m][:7].tobytes(), fmt
            assert mine["last six"][m].tobytes() == mine["all"][m][7:].tobytes(), fmt
            assert mine["sixth"][m].tobytes() == mine["all"][m][5:6].tobytes(), fmt
            assert mine["all"][m].tobytes() == first["all"][m].tobytes(), fmt


# ---- attention ------------------------------------------------------------------------

KV_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3}


def _pages(cache, kv_dtype: str):
    """The pages in kv_dtype (int8: with a scale per token and head), and their float values."""
    k, v = (np.asarray(x, np.float32) for x in (cache.k, cache.v))
    if kv_dtype != "int8":
        held = [np.asarray(jnp.asarray(x, kv_dtype)) for x in (k, v)]
        return [h.tobytes() for h in held], [np.asarray(jnp.asarray(h, jnp.float32)) for h in held]
    data, values = [], []
    for x in (k, v):
        scale = np.abs(x).max(axis=-1) / 127
        q = np.round(x / scale[..., None]).astype(np.int8)
        data.append(q.tobytes())
        values.append(q.astype(np.float32) * scale[..., None])
        data.append(scale.astype(np.float32).tobytes())
    return [data[0], data[2], data[1], data[3]], values  # k, v, then their scales


def _attention(run, build, case, kv_dtype, *, window=0, soft_cap=0.0, split_keys=0, threads=1):
    q = np.asarray(case.q, np.float32)
    L, P, page, Hkv, D = case.cache.k.shape
    tables = np.asarray(case.md.page_tables, np.int32)
    S = tables.shape[0]
    pages, _ = _pages(case.cache, kv_dtype)
    problem = (_ints(q.shape[0], q.shape[1], D, Hkv, S, L, P, page, tables.shape[1], LAYER,
                     KV_DTYPES[kv_dtype], window, split_keys, threads)
               + np.asarray([D ** -0.5, soft_cap], np.float32).tobytes() + q.tobytes()
               + b"".join(pages) + np.asarray(case.md.query_start_loc, np.int32).tobytes()
               + np.asarray(case.md.kv_lens, np.int32).tobytes() + tables.tobytes())
    return np.frombuffer(run(build, "attention", problem), np.float32).reshape(q.shape)


# (kind, group, head dim, page size, kv dtype, window, soft cap, split keys x threads)
ACASES = [("mixed", 3, 64, 16, "float32", 0, 0.0, (0, 1)),
          ("decode", 4, 128, 16, "float16", 0, 0.0, (0, 1)),
          ("prefill", 1, 64, 64, "bfloat16", 7, 0.0, (0, 1)),
          ("mixed", 8, 64, 16, "int8", 0, 30.0, (0, 1)),
          ("decode", 2, 64, 16, "float32", 0, 0.0, (16, 2))]  # decodes cut by keys, combined


@pytest.fixture(scope="module")
def attention_outputs(run):
    results = []
    for i, (kind, group, d, page, kv_dtype, window, cap, (split, threads)) in enumerate(ACASES):
        case = make_case(kind, num_kv_heads=2, group=group, head_dim=d, page_size=page, seed=i)
        _, values = _pages(case.cache, kv_dtype)
        want = oracle(case.q, KVCache(*(jnp.asarray(v) for v in values)), LAYER, case.md,
                      sm_scale=d ** -0.5, sliding_window=window or None, soft_cap=cap or None)
        got = {b: _attention(run, b, case, kv_dtype, window=window, soft_cap=cap,
                             split_keys=split, threads=threads)
               for b, why in BUILDS.items() if why is None}
        results.append((ACASES[i], case.num_real_rows, want, got))
    return results


@pytest.mark.parametrize("build", list(BUILDS), ids=[NAMES[b] for b in BUILDS])
def test_attention_matches_float64_in_every_variant(build, attention_outputs):
    if BUILDS[build]:
        pytest.skip(BUILDS[build])
    for params, real_rows, want, got in attention_outputs:
        out = got[build]
        err = np.abs(out - want).max() / np.abs(want).max()
        assert err < 1e-5, (params, err)
        assert not np.isnan(out).any() and not out[real_rows:].any(), params


@pytest.mark.parametrize("build", list(BUILDS), ids=[NAMES[b] for b in BUILDS])
def test_attention_variants_give_the_same_bits(build, attention_outputs):
    if BUILDS[build]:
        pytest.skip(BUILDS[build])
    for params, _, _, got in attention_outputs:
        assert got[build].tobytes() == next(iter(got.values())).tobytes(), params


def test_the_kernels_own_variant_is_among_those_checked():
    """What `auto` picks on this CPU is one of the builds above (so the kernel the engine runs
    here is the one these tests hold to the references)."""
    picked = native.variant("qmatmul")
    if picked is None:
        pytest.skip(f"no CPU kernel here: {native.reason('qmatmul')}")
    assert any(v == picked and why is None for (v, _), why in BUILDS.items())


def test_the_engine_flag_offers_every_choice():
    from engine.config import CPU_KERNELS, EngineConfig

    assert CPU_KERNELS == native.CHOICES
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        EngineConfig(model="m", cpu_kernels="sse2")


def test_a_variant_this_cpu_cannot_run_is_refused():
    other = "neon" if X86 else "avx2"
    assert not native.runs_here(other)
    with pytest.raises(ValueError, match=f"--cpu-kernels {other}: this CPU"):
        native.choose(other)
    assert native.runs_here("avx2", {"avx2", "fma", "f16c"}, "x86_64")
    assert not native.runs_here("avx512", {"avx2", "fma", "f16c"}, "x86_64")
    assert native.runs_here("neon", set(), "aarch64")
    assert native.runs_here("portable", set(), "riscv64")
