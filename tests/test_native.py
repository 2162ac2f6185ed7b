"""xlaserve's CPU kernel (ops/native/qmatmul.cc) against its reference, XLA's own quantized
matmul (ops/quantized_linear.linear with native=False): every format it takes, one layer of a
stack or a lone matrix, 1 to 8 rows; the shapes it refuses; the fallback where it cannot be
built; and whole models with it on and off."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import save_tiny_hf

from models.generate import GreedyDecoder
from models.gguf_blocks import repack
from models.loader import load_model
from ops import native
from ops.cpu_linear import NATIVE_MAX_ROWS, many_rows_pay, native_fits, native_linears
from ops.quantization import QuantFormat, pack, quantize, scheme_format, unpack
from ops.quantized_linear import linear, linears, stacked

# The kernel's own tests; the fallback's (test_without_a_compiler_xla_runs_instead) run on
# every machine, those that cannot build the kernel above all.
needs_kernels = pytest.mark.skipif(not native.available("qmatmul"),
                                   reason=f"CPU kernel unavailable: {native.reason('qmatmul')}")

T = gguf.GGMLQuantizationType


def _gguf(tensor_type):
    def make(w):
        return repack(gguf.quants.quantize(w, tensor_type).reshape(-1), tensor_type, w.shape)
    return make


FORMATS = {
    "Q4_1": _gguf(T.Q4_1), "Q4_0": _gguf(T.Q4_0), "Q8_0": _gguf(T.Q8_0),
    "int4 group 32": lambda w: quantize(w, scheme_format("int4")),
    "int4 group 128": lambda w: quantize(w, QuantFormat(4, 128)),
    "int8 per channel": lambda w: quantize(w, scheme_format("int8")),
    # Q6_K's groups of 16, and a Q4_K_M stack's (models/gguf_blocks.common_format)
    "int8 group 16": lambda w: quantize(w, QuantFormat(8, 16)),
    "int8 group 16 with minimums": lambda w: quantize(w, QuantFormat(8, 16, has_min=True)),
}


def _stack(make, rows, cols, layers=3, seed=0, packed=False):
    rng = np.random.default_rng(seed)
    mats = [make((rng.standard_normal((rows, cols)) * rng.uniform(0.1, 2, (rows, 1)))
                 .astype(np.float32)) for _ in range(layers)]
    if packed:
        mats = [{**m, "q": pack(m["q"], "min" not in m, lanes=True)} for m in mats]
    return jax.tree.map(lambda *a: jnp.asarray(np.stack(a)), *mats)


# 200 rows: not a multiple of 32; 608 columns: 19 blocks of 32, so the 4-bit path
# (PackedTile, 4 blocks a load) ends on a partial load (not for groups of 128)
CASES = [(fmt, packed, rows, cols)
         for fmt, packed in [(f, False) for f in FORMATS] + [
             (f, True) for f in FORMATS if f.startswith(("Q4", "int4"))]
         for rows, cols in [(200, 256), (64, 1536), (40, 608)]
         if not (fmt == "int4 group 128" and cols % 128)]


@needs_kernels
@pytest.mark.parametrize("fmt,packed,rows,cols", CASES,
                         ids=[f"{r}-{c}-{f}{' packed' if p else ''}" for f, p, r, c in CASES])
def test_kernel_matches_xla(fmt, packed, rows, cols):
    stack = _stack(FORMATS[fmt], rows, cols, packed=packed)
    values = _stack(FORMATS[fmt], rows, cols)  # the same matrices, one value per int8
    if packed:
        np.testing.assert_array_equal(np.asarray(unpack(stack["q"], "min" not in stack,
                                                        lanes=True)),
                                      np.asarray(values["q"]))
    rng = np.random.default_rng(1)
    run = jax.jit(lambda x, w, layer: linear(x, stacked(w, layer), native=True, lanes=True))
    for t in (1, 3, 5, 8):  # the kernel tiles rows by 4: 1, 3, 4 + 1, 4 + 4 (a lone row: 1, 5)
        x = jnp.asarray(rng.standard_normal((t, cols)).astype(np.float32))
        for layer in (0, 2):
            one = jax.tree.map(lambda a, i=layer: a[i], stack)
            want = np.asarray(linear(x, jax.tree.map(lambda a, i=layer: a[i], values)))
            # An 8-bit value with a minimum per group of 16: the minimums' share (the minimum
            # times the group's sum of x) and the values' cancel in part, so float32's error
            # is a larger share of the result.
            scale = np.abs(want).max() * (4 if fmt == "int8 group 16 with minimums" else 1)
            assert native_fits(x, stacked(stack, layer), lanes=True)
            assert native_fits(x, one, lanes=True)
            got = np.asarray(run(x, stack, jnp.int32(layer)))
            alone = np.asarray(jax.jit(
                lambda x, w: linear(x, w, native=True, lanes=True))(x, one))
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
            np.testing.assert_allclose(alone, want, rtol=0, atol=2e-6 * scale)
    # More rows than the kernel takes: XLA's own path reads the same values, in its order
    x = jnp.asarray(rng.standard_normal((NATIVE_MAX_ROWS + 4, cols)).astype(np.float32))
    one = jax.tree.map(lambda a: a[1], stack)
    want = np.asarray(linear(x, jax.tree.map(lambda a: a[1], values)))
    assert not native_fits(x, one, lanes=True)
    np.testing.assert_allclose(np.asarray(linear(x, one, native=True, lanes=True)), want,
                               rtol=0, atol=2e-6 * np.abs(want).max() * 4)


@needs_kernels
def test_one_call_multiplies_the_same_rows_by_several_matrices():
    """q, k and v (or gate and up) in one call: each product as the kernel gives it alone,
    for matrices of different formats and heights (their chunks of rows interleave over the
    threads), one layer index for all."""
    mats = [_stack(FORMATS["Q4_1"], 200, 256, packed=True, seed=3),
            _stack(FORMATS["int8 per channel"], 64, 256, seed=4),
            _stack(FORMATS["int4 group 128"], 96, 256, packed=True, seed=5),
            _stack(FORMATS["Q8_0"], 40, 256, seed=6)]
    rng = np.random.default_rng(7)
    for t in (1, 5):
        x = jnp.asarray(rng.standard_normal((t, 256)).astype(np.float32))
        for n in (2, 3, 4):
            got = jax.jit(lambda x, ws, layer: linears(
                x, [stacked(w, layer) for w in ws], native=True, lanes=True))(
                    x, mats[:n], jnp.int32(2))
            assert [g.shape for g in got] == [(t, m["q"].shape[1]) for m in mats[:n]]
            for g, m in zip(got, mats[:n], strict=True):
                alone = jax.jit(
                    lambda x, w: linear(x, stacked(w, 2), native=True, lanes=True))(x, m)
                np.testing.assert_array_equal(np.asarray(g), np.asarray(alone))
    with pytest.raises(ValueError, match="share one layer"):
        native_linears(x, [stacked(mats[0], 0), stacked(mats[1], 1)])


@needs_kernels
def test_x_in_8_bits_reaches_the_kernel():
    """x_bits 8 (--cpu-activation-dtype int8): packed 4-bit products take each block of 32 of
    x rounded to 8 bits, for one matrix and for several in one call; 8-bit values (read as
    floats) do not change; a row's product does not depend on the other rows; other widths
    are refused."""
    packed = _stack(FORMATS["Q4_1"], 200, 608, packed=True, seed=8)
    values = _stack(FORMATS["Q4_1"], 200, 608, seed=8)  # the same values, one per int8
    q8 = _stack(FORMATS["Q8_0"], 40, 608, seed=9)
    rng = np.random.default_rng(10)
    x = rng.standard_normal((5, 608)).astype(np.float32)
    blocks = x.reshape(5, -1, 32)
    top = np.abs(blocks).max(axis=2, keepdims=True)
    held = (np.clip(np.rint(blocks * (np.float32(127) / top)), -127, 127)
            * (top / np.float32(127))).reshape(5, 608)
    layer = 1
    one = jax.tree.map(lambda a: a[layer], values)
    want = np.asarray(linear(jnp.asarray(held, jnp.float32), one)).astype(np.float64)
    exact = np.asarray(linear(jnp.asarray(x), one))
    run = jax.jit(lambda x, ws, bits: linears(x, [stacked(w, layer) for w in ws], native=True,
                                              lanes=True, x_bits=bits), static_argnums=2)
    got8, q8_8 = (np.asarray(y) for y in run(jnp.asarray(x), [packed, q8], 8))
    got24, q8_24 = (np.asarray(y) for y in run(jnp.asarray(x), [packed, q8], 24))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got8, want, rtol=0, atol=2e-6 * scale)
    np.testing.assert_allclose(got24, exact, rtol=0, atol=2e-6 * scale)
    assert 1e-4 * scale < np.abs(got8 - got24).max() < 2e-2 * scale
    np.testing.assert_array_equal(q8_8, q8_24)
    alone = jax.jit(
        lambda x: linear(x, stacked(packed, layer), native=True, lanes=True, x_bits=8))
    for t in range(5):
        np.testing.assert_array_equal(np.asarray(alone(jnp.asarray(x[t:t + 1])))[0], got8[t])
    with pytest.raises(ValueError, match="x_bits"):
        native_linears(jnp.asarray(x), [stacked(packed, layer)], x_bits=16)


@needs_kernels
def test_cpu_activation_dtype_int8_decodes_a_model(tmp_path):
    """set_run_options' cpu_activation_dtype "int8" (EngineConfig.cpu_activation_dtype):
    a 4-bit model's decode logits move by Q8's rounding and no more; "float32" is the
    default; other names are refused. (Its 8-bit LM head takes x in 8 bits too where the
    kernel holds it in its order: native.multiplies_bytes.)"""
    from models.run_options import set_run_options

    path = save_tiny_hf(tmp_path, family="llama")
    int8 = load_model(path, dtype="float32", quantization="int4")
    full = load_model(path, dtype="float32", quantization="int4")
    set_run_options(int8, cpu_activation_dtype="int8")
    set_run_options(full)
    assert (int8.x_bits, full.x_bits) == (8, 24)
    prompt = [5, 17, 3, 99, 42, 7, 150, 23]
    # the prompt's rows (padded past the kernel's few) run XLA's product in either, except
    # where the kernel takes 8-bit x at every row count (many_rows_pay: VNNI); the first
    # decode after the same first token runs the kernel
    tokens8, logits8 = GreedyDecoder(int8, max_len=64).generate(prompt, 2)
    tokens24, logits24 = GreedyDecoder(full, max_len=64).generate(prompt, 2)
    assert tokens8[0] == tokens24[0]
    head8 = any(f.lanes and not f.packed for f in dict(full.quant).values())  # the 8-bit head
    prompt8 = many_rows_pay(8)  # the prompt's rows in 8 bits too
    # a tiny random model's logits move more than a real one's: 8 positions of K/V in 8 bits
    bound = 0.1 if prompt8 else 0.05
    if head8 or prompt8:
        diff = np.abs(np.asarray(logits8[0]) - np.asarray(logits24[0])).max()
        assert 0 < diff < bound * np.abs(logits24[0]).max()
    else:
        np.testing.assert_array_equal(logits8[0], logits24[0])
    diff = np.abs(np.asarray(logits8[1]) - np.asarray(logits24[1])).max()
    assert 0 < diff < bound * np.abs(logits24[1]).max()
    with pytest.raises(ValueError, match="activation dtype"):
        set_run_options(full, cpu_activation_dtype="int4")


@needs_kernels
def test_what_the_kernel_refuses_goes_to_xla():
    stack = _stack(FORMATS["Q4_1"], 64, 256)
    rng = np.random.default_rng(2)
    many = jnp.asarray(rng.standard_normal((NATIVE_MAX_ROWS + 1, 256)).astype(np.float32))
    assert not native_fits(many, stacked(stack, 1))
    assert native_fits(many, stacked(stack, 1), any_rows=True)  # --batch-invariant
    assert not native_fits(many[:1].astype(jnp.bfloat16), stacked(stack, 1))
    assert not native_fits(many[:1], jnp.ones((64, 256)))  # float weights
    one = jax.tree.map(lambda a: a[1], stack)
    bf16 = jax.jit(lambda x, w: linear(x, stacked(w, 1), native=True))(
        many.astype(jnp.bfloat16), stack)  # XLA's dot, in bfloat16
    want = np.asarray(linear(many, one))
    np.testing.assert_allclose(np.asarray(bf16, np.float32), want, rtol=0,
                               atol=2e-2 * np.abs(want).max())


@needs_kernels
def test_packed_4_bit_products_with_8_bit_x_take_every_row_count_where_vnni_multiplies():
    """--cpu-activation-dtype int8: a prompt's chunk (more than NATIVE_MAX_ROWS rows) of a
    packed 4-bit matrix runs the kernel where VNNI's 8-bit dot products do
    (cpu_linear.many_rows_pay), so its rows are the bits each gets alone; with x in 24 bits,
    and for the 8-bit head's order (lanes8), XLA's product stays."""
    stack = _stack(FORMATS["Q4_1"], 200, 608, packed=True)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3 * NATIVE_MAX_ROWS + 5, 608)).astype(np.float32)
    w = stacked(stack, 1)
    vnni = native.multiplies_bytes()
    assert native_fits(jnp.asarray(x), w, lanes=True, x_bits=8) == vnni
    assert not native_fits(jnp.asarray(x), w, lanes=True, x_bits=24)
    # --cpu-matmul-dtype bfloat16 asks for XLA's bfloat16 product (AMX's) at many rows
    assert not native_fits(jnp.asarray(x), w, lanes=True, x_bits=8, wide_dtype=jnp.bfloat16)
    head = {"q": jnp.zeros((64, 608), jnp.uint8), "scale": jnp.ones((64, 19), jnp.float16)}
    assert not native_fits(jnp.asarray(x), head, lanes=True, x_bits=8)  # lanes8
    f = jax.jit(lambda x, w: linear(x, stacked(w, 1), native=True, lanes=True, x_bits=8))
    whole = np.asarray(f(jnp.asarray(x), stack))
    alone = np.concatenate([np.asarray(f(jnp.asarray(x[i:i + 1]), stack))
                            for i in range(len(x))])
    if vnni:
        assert whole.tobytes() == alone.tobytes()
    else:  # XLA's float product of the dequantized matrix: close, other bits
        np.testing.assert_allclose(whole, alone, rtol=0, atol=0.05 * np.abs(alone).max())
        assert whole.tobytes() != alone.tobytes()


@needs_kernels
@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_0", "Q8_0", "int8 per channel"])
def test_a_rows_product_does_not_depend_on_the_other_rows(fmt):
    """A row's output is the same bits alone, in any tile of 1-4 rows, at any offset and
    beside any other rows (batch-invariant rows: a seeded request samples the same tokens
    alone or under load)."""
    packed = fmt.startswith("Q4")
    stack = _stack(FORMATS[fmt], 200, 608 if fmt != "int8 per channel" else 256,
                   packed=packed)
    cols = 608 if fmt != "int8 per channel" else 256
    x = np.random.default_rng(3).standard_normal((40, cols)).astype(np.float32)
    f = jax.jit(lambda x, w: linear(x, stacked(w, 1), native=True, lanes=True, any_rows=True))
    whole = np.asarray(f(jnp.asarray(x), stack))
    for rows in (1, 2, 3, 4, 5, 7, 9, 13):
        for start in (0, 1, 6):
            part = np.asarray(f(jnp.asarray(x[start:start + rows]), stack))
            assert part.tobytes() == whole[start:start + rows].tobytes(), (rows, start)


@needs_kernels
def test_kernel_rejects_a_layer_outside_the_stack():
    stack = _stack(FORMATS["int4 group 32"], 32, 64, layers=2)
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(Exception, match="layer out of range"):
        jax.jit(lambda x, w: linear(x, stacked(w, 2), native=True))(x, stack).block_until_ready()


def test_without_a_compiler_xla_runs_instead(tmp_path):
    """A machine where the kernel cannot be built (here: a compiler that always fails, an
    empty kernel cache) loads models and computes the same products through XLA; the failed
    build is remembered, so the next process neither retries it nor waits for it."""
    code = (
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from ops import native\n"
        "from ops.quantization import quantize, scheme_format\n"
        "from ops.quantized_linear import linear\n"
        "assert not native.available('qmatmul') and native.identity() == 'off,off'\n"
        "print('reason:', native.reason('qmatmul'))\n"
        "w = quantize(np.ones((32, 64), np.float32), scheme_format('int4'))\n"
        "y = linear(jnp.ones((1, 64), jnp.float32), jax.tree.map(jnp.asarray, w), native=True)\n"
        "assert np.allclose(np.asarray(y), 64.0, rtol=1e-3), y\n")
    # The compiler case turns the kernels on, should this run have them off.
    for env, expected in [({"CXX": "false", "XLASERVE_CPU_KERNELS": "auto"},
                           "compiler 'false' does not run"),
                          ({"XLASERVE_CPU_KERNELS": "none"}, "XLASERVE_CPU_KERNELS=none")]:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env},
                              cwd=os.path.dirname(os.path.dirname(__file__)))
        assert done.returncode == 0, done.stderr
        assert expected in done.stdout
    # A compiler that runs but cannot build the kernels: each failed build is remembered.
    fails = tmp_path / "fails.sh"
    fails.write_text('#!/bin/sh\n'
                     'case "$*" in *--version*) echo fails 1.0;; *) echo no >&2; exit 1;; esac\n')
    fails.chmod(0o755)
    for attempt in range(2):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": str(fails),
                                   "XLASERVE_CPU_KERNELS": "auto"},
                              cwd=os.path.dirname(os.path.dirname(__file__)))
        assert done.returncode == 0, done.stderr
        assert "failed: no" in done.stdout
        assert ("an earlier build" in done.stdout) == (attempt == 1)
    assert len(list((tmp_path / "xlaserve" / "kernels").glob("*.failed"))) >= 2


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_models_decode_alike_with_and_without_the_kernel(family, tmp_path):
    """Greedy tokens equal and logits within float error, kernel on and off, for a stacked
    family and one scanned a period of layer kinds at a time (Gemma 3)."""
    path = save_tiny_hf(tmp_path, family=family)
    on = load_model(path, dtype="float32", quantization="int4")
    assert on.native_matmuls
    off = load_model(path, dtype="float32", quantization="int4")
    off.native_matmuls = False
    prompt = [5, 17, 3, 99, 42, 7, 150, 23]
    tokens_on, logits_on = GreedyDecoder(on, max_len=64).generate(prompt, 12)
    tokens_off, logits_off = GreedyDecoder(off, max_len=64).generate(prompt, 12)
    assert tokens_on == tokens_off
    np.testing.assert_allclose(logits_on, logits_off, rtol=0,
                               atol=1e-4 * np.abs(logits_off).max())


def test_cpu_kernels_none_is_an_engine_flag(tmp_path):
    """EngineConfig.cpu_kernels "none" (--cpu-kernels none) turns the kernels off in its
    process before the engine loads its model: XLA's matmuls and the reference attention
    run, and the engine still generates."""
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from pathlib import Path\n"
        "from tiny_models import save_tiny_hf\n"
        "from engine.config import EngineConfig\n"
        "from engine.llm_engine import LLMEngine\n"
        "from engine.sampling_params import SamplingParams\n"
        "from flax import nnx\n"
        "from ops import native\n"
        f"path = save_tiny_hf(Path({str(tmp_path)!r}), family='llama')\n"
        "engine = LLMEngine(EngineConfig(model=str(path), dtype='float32', max_model_len=64,\n"
        "    max_num_seqs=2, max_num_batched_tokens=16, block_size=8,\n"
        "    cpu_kernels='none'), detokenize=False)\n"
        "assert not native.available('qmatmul')\n"
        "assert native.reason('qmatmul') == '--cpu-kernels none'\n"
        "model = nnx.merge(engine.runner.graphdef, engine.runner.state)\n"
        "assert model.attention_backend == 'reference' and not model.native_matmuls\n"
        "out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4,\n"
        "    ignore_eos=True))\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
        "print('off and generating')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "off and generating" in done.stdout


def test_multiplies_bound_is_avx2_without_vnni(monkeypatch):
    monkeypatch.setattr(native, "variant", lambda kernel: "avx2")
    monkeypatch.setattr(native, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert native.multiplies_bound()
    monkeypatch.setattr(native, "cpu_features", lambda: frozenset({"avx2", "avx_vnni"}))
    assert not native.multiplies_bound()
    for other in ("avx512", "neon", "portable", None):
        monkeypatch.setattr(native, "variant", lambda kernel, v=other: v)
        assert not native.multiplies_bound()


@needs_kernels
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_start_up_suggests_8_bit_activations_where_multiplies_bound(
        activations, tmp_path, monkeypatch, caplog):
    """On an AVX2 CPU without VNNI, a model with 4-bit products and float32 activations logs
    that --cpu-activation-dtype int8 may pay; with the flag set it does not."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    monkeypatch.setattr(native, "multiplies_bound", lambda kernel="qmatmul": True)
    caplog.set_level(logging.INFO, logger="engine.model_runner")
    path = save_tiny_hf(tmp_path, family="llama")
    LLMEngine(EngineConfig(model=str(path), dtype="float32", quantization="int4",
                           max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                           block_size=8, cpu_activation_dtype=activations), detokenize=False)
    assert "CPU kernels:" in caplog.text
    assert ("--cpu-activation-dtype int8 took" in caplog.text) == (activations == "float32")
    assert "%%" not in caplog.text
