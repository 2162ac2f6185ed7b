"""Quantization (ops/quantization.py, ops/quantized_linear.py, ops/xla_linear.py,
ops/cpu_linear.py, ops/vocab_blocks.py): GGUF
blocks taken over bit for bit, the quantized matmul against float references (weight-only,
and w8a8's int8 x int8), and quantized checkpoints."""

from __future__ import annotations

import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.gguf_blocks import EXACT, KEPT, common_format, repack, widen
from models.gguf_file import open_gguf
from ops import cpu_linear, native, quantization, vocab_blocks, xla_linear
from ops.quantization import QuantFormat, dequantize, quantize
from ops.quantized_linear import held_formats, linear

T = gguf.GGMLQuantizationType


def _weight(rows=24, cols=96, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)


@pytest.mark.parametrize("tensor_type", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_gguf_blocks_repack_bit_exact(tensor_type):
    w = _weight()
    raw = gguf.quants.quantize(w, tensor_type).reshape(-1)
    want = gguf.dequantize(raw, tensor_type).reshape(w.shape)
    parts = repack(raw, tensor_type, w.shape)
    fmt = KEPT[tensor_type]
    assert parts["q"].dtype == np.int8 and parts["q"].shape == w.shape
    assert parts["scale"].shape == (w.shape[0], w.shape[1] // 32)
    assert ("min" in parts) == fmt.has_min
    lo, hi = {T.Q8_0: (-127, 127), T.Q4_0: (-8, 7), T.Q4_1: (0, 15), T.Q5_0: (-16, 15),
              T.Q5_1: (0, 31)}[tensor_type]
    assert lo <= parts["q"].min() and parts["q"].max() <= hi
    got = dequantize(parts["q"], parts["scale"], parts.get("min"), xp=np)
    np.testing.assert_array_equal(got, want)
    jax_got = jax.jit(lambda p: dequantize(p["q"], p["scale"], p.get("min")))(parts)
    np.testing.assert_allclose(np.asarray(jax_got), want, rtol=1e-6, atol=1e-7)


def _random_blocks(tensor_type, count: int, seed: int = 0) -> np.ndarray:
    """`count` blocks of random bytes whose float16 fields (d, and m or dmin) are small
    finite numbers: every bit pattern of the rest is a valid block."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[tensor_type][1]
    raw = rng.integers(0, 256, (count, size), dtype=np.uint8)
    fields = {T.Q6_K: [208], T.Q4_1: [0, 2], T.Q5_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2]}
    for at in fields.get(tensor_type, [0]):
        raw[:, at:at + 2] = rng.uniform(-0.05, 0.05, (count, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("tensor_type", list(KEPT), ids=lambda t: t.name)
def test_every_kept_block_type_holds_the_gguf_packages_values(tensor_type):
    """Each block type's values, scales and minimums as our format hold them give the `gguf`
    package's dequantization: bit for bit for EXACT types, and for the K-types within the
    float16 rounding of each sub-block's scale and minimum (2^-11 of each term)."""
    values, _ = gguf.GGML_QUANT_SIZES[tensor_type]
    shape = (4, 16 * values)
    raw = _random_blocks(tensor_type, 64)
    want = gguf.dequantize(raw, tensor_type).reshape(shape)
    fmt = KEPT[tensor_type]
    parts = repack(raw, tensor_type, shape)
    assert parts["q"].dtype == np.int8 and parts["q"].shape == shape
    assert parts["scale"].dtype == np.float16 and parts["scale"].shape == (4, shape[1] // fmt.group)
    assert ("min" in parts) == fmt.has_min
    lo, hi = {T.Q8_0: (-128, 127), T.Q4_0: (-8, 7), T.Q4_1: (0, 15), T.Q5_0: (-16, 15),
              T.Q5_1: (0, 31), T.Q4_K: (0, 15), T.Q5_K: (0, 31), T.Q6_K: (-32, 31)}[tensor_type]
    assert parts["q"].min() == lo and parts["q"].max() == hi  # 1,024 random values reach both
    got = dequantize(parts["q"], parts["scale"], parts.get("min"), xp=np)
    if tensor_type in EXACT:
        np.testing.assert_array_equal(got, want)
    else:
        group = lambda a: np.repeat(np.abs(a.astype(np.float32)), fmt.group, axis=-1)
        bound = group(parts["scale"]) * np.abs(parts["q"]) + (
            group(parts["min"]) if fmt.has_min else 0)
        assert np.all(np.abs(got - want) <= bound * 2.0 ** -11 + 1e-12)
        assert not np.array_equal(got, want)  # the rounding is real: the test sees it


def test_a_stack_of_mixed_block_types_takes_one_format_that_holds_each():
    """A Q4_K_M file's down projections mix Q4_K and Q6_K layers: the stack is held in 8 bits,
    groups of 16, with minimums, each layer's values as its own type gives them; Q4_0 with
    Q4_1 stays in 4 bits, its symmetric values moved onto [0, 15]; a float layer, or groups
    that do not divide, leave the stack without a format."""
    assert common_format({KEPT[T.Q4_K], KEPT[T.Q6_K]}) == QuantFormat(8, 16, has_min=True)
    assert common_format({KEPT[T.Q5_0], KEPT[T.Q8_0]}) == QuantFormat(8, 32)
    assert common_format({KEPT[T.Q4_0], KEPT[T.Q4_1]}) == QuantFormat(4, 32, has_min=True)
    assert common_format({KEPT[T.Q4_K], None}) is None
    assert common_format({QuantFormat(8, 32), QuantFormat(8, 48)}) is None
    for tensor_type, fmt in [(T.Q4_K, QuantFormat(8, 16, True)), (T.Q6_K, QuantFormat(8, 16, True)),
                             (T.Q4_0, QuantFormat(4, 32, True)), (T.Q8_0, QuantFormat(8, 16))]:
        values, _ = gguf.GGML_QUANT_SIZES[tensor_type]
        shape = (2, 8 * values)
        parts = repack(_random_blocks(tensor_type, 16, seed=1), tensor_type, shape)
        wide = widen(parts, fmt)
        assert wide["scale"].shape == (2, shape[1] // fmt.group) and ("min" in wide) == fmt.has_min
        if fmt.bits == 4:
            assert 0 <= wide["q"].min() and wide["q"].max() <= 15
        np.testing.assert_array_equal(
            dequantize(wide["q"], wide["scale"], wide.get("min"), xp=np),
            dequantize(parts["q"], parts["scale"], parts.get("min"), xp=np))


def test_a_q4_k_m_file_runs_its_own_blocks(gemma3_gguf):
    """Gemma 3 270M's Q4_K_M file under auto: every matrix takes over the file's blocks, a
    stack of mixed types in the format that holds them all, and the loaded weights are the
    file's (within the K-types' float16 scales); int4 keeps the 4-bit stacks and requantizes
    the wider ones."""
    from models.gguf_loader import load_gguf_params
    from models.loader import load_config

    cfg = load_config(gemma3_gguf)
    params, auto = load_gguf_params(gemma3_gguf, cfg, jnp.float32, "auto")
    assert auto == {"embed": QuantFormat(8, 32), "layers.wq": QuantFormat(8, 32),  # Q8_0, Q5_0
                    "layers.wk": QuantFormat(8, 32), "layers.wv": QuantFormat(8, 32),
                    "layers.wo": QuantFormat(4, 32, True),  # Q4_K
                    "layers.w_gate": QuantFormat(8, 32), "layers.w_up": QuantFormat(8, 32),
                    "layers.w_down": QuantFormat(8, 16, True)}  # Q4_K and Q6_K layers
    index = open_gguf(gemma3_gguf)
    types = set()
    for t in index.tensors:  # the first layer of each type
        if t.name.endswith("ffn_down.weight") and t.tensor_type not in types:
            layer = int(t.name.split(".")[1])
            types.add(t.tensor_type)
            q, scale, minimum = (params["layers"][k][layer]
                                 for k in ("w_down", "w_down_scale", "w_down_min"))
            got = dequantize(q, scale, minimum, xp=np)
            group = lambda a: np.repeat(np.abs(a.astype(np.float32)), 16, axis=-1)
            bound = (group(scale) * np.abs(q) + group(minimum)) * 2.0 ** -11
            assert np.all(np.abs(got - index.values(t)) <= bound + 1e-12), t.name
    assert types == {T.Q4_K, T.Q6_K}
    int4 = load_gguf_params(gemma3_gguf, cfg, jnp.float32, "int4")[1]
    assert int4["layers.wo"] == int4["layers.w_down"] == QuantFormat(4, 32, True)
    assert int4["layers.wq"] == QuantFormat(4, 32, True)  # Q5_0: 5 bits, requantized
    # its Q8_0 embedding: the frequent rows as they are, the rest in 4 bits
    assert int4["embed"] == QuantFormat(8, 32) and int4["embed_rare"] == QuantFormat(4, 32, True)


def test_default_model_blocks_repack_bit_exact(default_gguf):
    index = open_gguf(default_gguf)
    seen = set()
    for t in index.tensors:
        if t.tensor_type in KEPT and t.tensor_type not in seen:
            seen.add(t.tensor_type)
            shape = tuple(reversed(t.shape))
            parts = repack(index.raw(t), t.tensor_type, shape)
            got = dequantize(parts["q"], parts["scale"], parts.get("min"), xp=np)
            np.testing.assert_array_equal(got, index.values(t), err_msg=t.name)
    assert seen == {T.Q4_1, T.Q8_0}


FORMATS = {
    "int8 per channel": (QuantFormat(8, 0), 0.01),
    "int8 group 32": (QuantFormat(8, 32), 0.01),
    "int4 group 32": (QuantFormat(4, 32), 0.2),
    "int4 group 32 with minimums": (QuantFormat(4, 32, True), 0.15),
}


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_int4_scale_is_the_first_value_of_largest_magnitude(xp):
    """Symmetric int4 maps the group's value of largest magnitude to -8; between +a and -a
    the first one wins, as in llama.cpp's Q4_0."""
    w = np.zeros((2, 32), np.float32)
    w[0, 3], w[0, 7] = 2.0, -2.0   # +2 first: scale -0.25
    w[1, 3], w[1, 7] = -2.0, 2.0   # -2 first: scale 0.25
    w[:, 10] = 1.0
    parts = quantize(xp.asarray(w), QuantFormat(4, 32), xp=xp)
    np.testing.assert_array_equal(np.asarray(parts["scale"], np.float32)[:, 0], [-0.25, 0.25])
    q = np.asarray(parts["q"])
    assert (q[0, 3], q[0, 7], q[0, 10]) == (-8, 7, -4)  # -2 / -0.25 = 8, clipped
    assert (q[1, 3], q[1, 7], q[1, 10]) == (-8, 7, 4)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("blocks", [1, 4])
def test_quantized_matmul_matches_float(name, rows, blocks, monkeypatch):
    fmt, tolerance = FORMATS[name]
    # blocks=4: group formats at more than one row dequantize a quarter of the rows at a time
    monkeypatch.setattr(xla_linear, "CHUNK_BYTES", 40 * 128 * 4 // blocks)
    assert xla_linear.chunk_rows(40, 128 * 4) == 40 // blocks
    w = _weight(40, 128)
    parts = quantize(w, fmt)
    assert parts["scale"].shape == (40, fmt.scale_columns(128))
    x = np.random.default_rng(1).standard_normal((rows, 128)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, w: linear(x, w))(x, parts))  # traced anew: CHUNK_BYTES
    # Exactly the dequantized weight's product (up to float summation order) ...
    exact = x @ dequantize(parts["q"], parts["scale"], parts.get("min"), xp=np).T
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-4)
    # ... and the float weight's within the format's quantization error.
    want = x @ w.T
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tolerance
    lo, hi = (-127, 127) if fmt.bits == 8 else (0, 15) if fmt.has_min else (-8, 7)
    assert lo <= parts["q"].min() and parts["q"].max() <= hi


@pytest.mark.parametrize("name", [*FORMATS, "int4 group 32 packed", "int4 group 32 packed with "
                                  "minimums", "float"])
def test_many_rows_multiply_in_the_wide_dtype(name):
    """`wide_dtype` (--cpu-matmul-dtype): past NATIVE_MAX_ROWS rows x and the dequantized
    weight (per channel: its int8 values, exact) are each rounded once to bfloat16 and their
    products summed in float32; up to it, nothing changes."""
    w = _weight(40, 128)
    if name == "float":
        parts, dense = jnp.asarray(w), w
    else:
        fmt, _ = FORMATS[name.replace(" packed", "")]
        parts = quantize(w, fmt)
        dense = np.asarray(dequantize(parts["q"], parts["scale"], parts.get("min"), xp=np))
        if "packed" in name:
            parts["q"] = quantization.pack(parts["q"], not fmt.has_min)
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)
    rows = cpu_linear.NATIVE_MAX_ROWS + 8
    x = np.random.default_rng(3).standard_normal((rows, 128)).astype(np.float32)
    wide = jax.jit(lambda x, w: linear(x, w, wide_dtype=jnp.bfloat16))
    got = np.asarray(wide(x, parts))
    assert got.dtype == np.float32
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
    # float32 sums of the rounded products (per channel: int8 values, exact; scales after)
    rounded = dense.astype(np.float64) if name == "int8 per channel" else bf16(dense)
    assert rel(got, bf16(x) @ rounded.T) < 1e-5
    assert rel(got, x.astype(np.float64) @ dense.astype(np.float64).T) > 5e-4  # rounded
    few = x[:cpu_linear.NATIVE_MAX_ROWS]
    np.testing.assert_array_equal(np.asarray(wide(few, parts)),
                                  np.asarray(jax.jit(linear)(few, parts)))


def test_wide_dtype_is_bfloat16_only_when_asked_for_a_float32_model():
    assert xla_linear.wide_dtype(jnp.float32) is None  # the default: float32
    assert xla_linear.wide_dtype(jnp.float32, "float32") is None
    assert xla_linear.wide_dtype(jnp.float32, "bfloat16") == jnp.bfloat16
    assert xla_linear.wide_dtype(jnp.bfloat16, "bfloat16") is None  # already narrow
    with pytest.raises(ValueError, match="one of float32, bfloat16"):
        xla_linear.wide_dtype(jnp.float32, "float16")
    from engine.config import CPU_MATMUL_DTYPES, EngineConfig
    assert CPU_MATMUL_DTYPES == xla_linear.WIDE_DTYPES
    with pytest.raises(ValueError, match="cpu_matmul_dtype"):
        EngineConfig(model="m", cpu_matmul_dtype="float16")
    # --cpu-activation-dtype: the engine's names are the kernel's widths' names
    from engine.config import CPU_ACTIVATION_DTYPES
    assert CPU_ACTIVATION_DTYPES == tuple(cpu_linear.X_BITS)
    assert EngineConfig(model="m").cpu_activation_dtype == "float32"
    with pytest.raises(ValueError, match="cpu_activation_dtype"):
        EngineConfig(model="m", cpu_activation_dtype="int4")


@pytest.mark.parametrize("fmt,storage", [
    (None, None), (QuantFormat(8, 0), jnp.int8), (QuantFormat(8, 32), jnp.int8),
    (QuantFormat(4, 32), jnp.int4), (QuantFormat(4, 32, has_min=True), jnp.uint4),
    (QuantFormat(4, 32, has_min=True), jnp.int8)], ids=str)
def test_one_row_as_a_gpu_runs_it(monkeypatch, fmt, storage):
    """On a GPU one row is a multiply and a sum, no dot, for float weights and every
    weight-only format (4-bit values in the GPU's own 4-bit dtypes too), sliced out of a
    layer stack as the model does: the same product."""
    monkeypatch.setattr(xla_linear, "reduces_one_row", lambda: True)
    stack = np.stack([_weight(40, 128, seed=s) for s in (0, 1)])
    if fmt is None:
        parts, dense = jnp.asarray(stack), stack
    else:
        parts = quantize(stack, fmt)
        dense = np.asarray(dequantize(parts["q"], parts["scale"], parts.get("min"), xp=np))
        parts["q"] = jnp.asarray(parts["q"]).astype(storage)
    x = np.random.default_rng(2).standard_normal((1, 128)).astype(np.float32)
    layer = lambda w, i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), w)
    assert "dot_general" not in str(jax.make_jaxpr(
        lambda x, w: linear(x, layer(w, 1)))(x, parts))
    exact = x @ dense[1].T
    for out_dtype in (None, jnp.bfloat16):
        got = jax.jit(lambda x, w, d=out_dtype: linear(x, layer(w, 1), d))(x, parts)
        assert got.shape == (1, 40) and got.dtype == (out_dtype or jnp.float32)
        np.testing.assert_allclose(np.asarray(got, np.float32), exact, rtol=1e-2 if out_dtype
                                   else 1e-5, atol=1e-4 if out_dtype is None else 2e-2)


def test_held_bytes_count_4_bit_values_as_half_a_byte():
    assert quantization.held_bytes(jnp.zeros((8, 64), jnp.int4)) == 256
    assert quantization.held_bytes(jnp.zeros((8, 64), jnp.uint4)) == 256
    assert quantization.held_bytes(jnp.zeros((8, 64), jnp.int8)) == 512
    assert quantization.held_bytes(np.zeros((8, 64), np.float32)) == 2048


@pytest.mark.parametrize("has_min", [False, True])
@pytest.mark.parametrize("cols", [256, 608, 1536])  # no whole group; one and 3 blocks more; 3
def test_packed_values_in_the_kernels_order_are_the_same_weights(cols, has_min):
    """`lanes` (ops/native's order, as a model whose matmuls it runs holds its packed 4-bit
    values): byte 64k + 4b + j of each whole group of 16 blocks is block b's byte 4k + j, the
    blocks after the groups as `pack` has them; the values, the rows looked up and XLA's
    products of many rows are the same as from `pack`'s order."""
    fmt = QuantFormat(4, 32, has_min)
    parts = quantize(_weight(24, cols), fmt)
    blocks = quantization.pack(parts["q"], not has_min)
    lanes = quantization.pack(parts["q"], not has_min, lanes=True)
    whole = cols // 32 // 16 * 256
    assert lanes.shape == blocks.shape and (lanes[:, whole:] == blocks[:, whole:]).all()
    for g in range(whole // 256):
        for k, b, j in [(0, 0, 0), (0, 5, 3), (1, 0, 0), (3, 15, 3), (2, 7, 1)]:
            np.testing.assert_array_equal(lanes[:, 256 * g + 64 * k + 4 * b + j],
                                          blocks[:, 256 * g + 16 * b + 4 * k + j])
    if whole:
        assert (lanes != blocks).any()
    np.testing.assert_array_equal(quantization.from_lanes(lanes, xp=np), blocks)
    np.testing.assert_array_equal(quantization.to_lanes(blocks), lanes)
    for xp in (np, jnp):
        np.testing.assert_array_equal(
            np.asarray(quantization.unpack(xp.asarray(lanes), not has_min, lanes=True, xp=xp)),
            parts["q"])
    held = {**parts, "q": lanes}
    dense = dequantize(parts["q"], parts["scale"], parts.get("min"), xp=np)
    tokens = np.array([3, 0, 23, 11], np.int32)
    rows = jax.jit(lambda t, w: vocab_blocks.embedding(w, t, jnp.float32, lanes=True))(
        tokens, held)
    np.testing.assert_array_equal(np.asarray(rows), dense[tokens])
    x = np.random.default_rng(cols).standard_normal(
        (cpu_linear.NATIVE_MAX_ROWS + 4, cols)).astype(np.float32)
    got = jax.jit(lambda x, w: linear(x, w, lanes=True))(x, held)
    want = jax.jit(linear)(x, {**parts, "q": blocks})
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-5 * np.abs(np.asarray(want)).max())


# no whole group; 2, 3 and 0 blocks after one (576 and 608 by quads: 2 blocks, 3)
@pytest.mark.parametrize("cols, group", [(256, 32), (576, 32), (608, 32), (1536, 32),
                                         (256, 64), (576, 64), (1536, 64)])
def test_8_bit_values_in_the_kernels_order_are_the_same_weights(cols, group):
    """`to_lanes8` (ops/native's order for 8-bit values, where its kernel multiplies bytes):
    plus 128 as uint8; byte 128k + 64h + 4b + j of each whole group of 16 blocks is block b's
    input 16h + 4k + j, each quad of blocks after them its blocks' first halves, then their
    second. The values, the rows looked up, the kernel's products of a few rows and XLA's of
    many are the same as from one value per int8."""
    fmt = QuantFormat(8, group)
    parts = quantize(_weight(24, cols), fmt)
    q = parts["q"]
    lanes = quantization.to_lanes8(q)
    assert lanes.dtype == np.uint8 and lanes.shape == q.shape
    u = q.astype(np.int32) + 128
    whole = cols // 512 * 512
    for g in range(whole // 512):
        for k, h, b, j in [(0, 0, 0, 0), (0, 1, 5, 3), (1, 0, 0, 0), (3, 1, 15, 3), (2, 0, 7, 1)]:
            np.testing.assert_array_equal(lanes[:, 512 * g + 128 * k + 64 * h + 4 * b + j],
                                          u[:, 512 * g + 32 * b + 16 * h + 4 * k + j])
    tail = (cols - whole) // 32
    for quad in range(tail // 4 + (tail % 4 > 0)):
        n = min(4, tail - 4 * quad)
        for h, b, j in [(0, 0, 0), (1, n - 1, 15), (1, 0, 3), (0, n - 1, 9)]:
            at = whole + 128 * quad
            np.testing.assert_array_equal(lanes[:, at + 16 * n * h + 16 * b + j],
                                          u[:, at + 32 * b + 16 * h + j])
    for xp in (np, jnp):
        np.testing.assert_array_equal(
            np.asarray(quantization.from_lanes8(xp.asarray(lanes), xp=xp)), q)
    held = {**parts, "q": jnp.asarray(lanes)}
    dense = dequantize(q, parts["scale"], xp=np)
    np.testing.assert_array_equal(
        np.asarray(dequantize(lanes, parts["scale"], cols=cols, xp=np)), dense)
    tokens = np.array([3, 0, 23, 11], np.int32)
    rows = jax.jit(lambda t, w: vocab_blocks.embedding(w, t, jnp.float32, lanes=True, cols=cols))(
        tokens, held)
    np.testing.assert_array_equal(np.asarray(rows), dense[tokens])
    natural = {k: jnp.asarray(v) for k, v in parts.items()}
    for n in (3, cpu_linear.NATIVE_MAX_ROWS + 4):  # the kernel where it runs; XLA's product
        x = np.random.default_rng(cols + n).standard_normal((n, cols)).astype(np.float32)
        got = jax.jit(lambda x, w: linear(x, w, native=True, lanes=True))(x, held)
        want = jax.jit(lambda x, w: linear(x, w, native=True))(x, natural)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=1e-5 * np.abs(np.asarray(want)).max())


def test_8_bit_formats_take_the_kernels_order_where_it_multiplies_bytes(monkeypatch):
    """held_formats: where ops/native's kernel runs a float32 model's matmuls and multiplies
    bytes (native.multiplies_bytes), its 8-bit formats in groups of 32 times a power of two
    without minimums are held in the kernel's order; per-channel int8, groups of 16 and
    minimums keep one value per int8; elsewhere every 8-bit format does."""
    formats = {"q8_0": QuantFormat(8, 32), "g64": QuantFormat(8, 64),
               "channel": QuantFormat(8, 0), "g16": QuantFormat(8, 16),
               "min": QuantFormat(8, 32, has_min=True), "int4": QuantFormat(4, 32, True)}
    for multiplies in (True, False):
        monkeypatch.setattr(native, "multiplies_bytes", lambda kernel="qmatmul", m=multiplies: m)
        held = held_formats(jnp.float32, formats, sharded=False)
        if not cpu_linear.runs_native(jnp.float32, formats, sharded=False):
            assert not any(f.lanes for f in held.values())
            continue
        assert {n for n, f in held.items() if f.lanes and not f.packed} == (
            {"q8_0", "g64"} if multiplies else set())
        assert held["int4"].lanes and held["int4"].packed
    assert not held_formats(jnp.bfloat16, formats, sharded=False)["q8_0"].lanes
    with pytest.raises(ValueError, match="unsupported"):
        QuantFormat(8, 16, lanes=True)


def test_asymmetric_blocks_matmul():
    w = _weight(16, 64)
    raw = gguf.quants.quantize(w, T.Q4_1).reshape(-1)
    parts = repack(raw, T.Q4_1, w.shape)
    want = gguf.dequantize(raw, T.Q4_1).reshape(w.shape)
    for rows in (1, 5):
        x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(jax.jit(linear)(x, parts)), x @ want.T,
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_a_vocabulary_matrix_in_row_blocks_is_the_whole_one(native, rows):
    """int4's head: the frequent rows in 8 bits, the rest in 4 (packed, as the CPU kernel
    holds them): the embedding and the logits are the whole dequantized table's."""
    from ops import native as native_ops
    if native and not native_ops.available("qmatmul"):
        pytest.skip("no CPU kernel here")
    w = _weight(96, 64)
    frequent = quantize(w[:32], QuantFormat(8, 32))
    rare = quantize(w[32:], QuantFormat(4, 32, True))
    whole = np.concatenate([dequantize(b["q"], b["scale"], b.get("min"), xp=np)
                            for b in (frequent, rare)])
    if native:
        rare = {**rare, "q": quantization.pack(rare["q"], symmetric=False, lanes=True)}
    blocks = (frequent, rare)
    tokens = np.array([0, 31, 32, 95, 40, 3], np.int32)
    got = jax.jit(lambda b, t: vocab_blocks.embedding(b, t, jnp.float32, native))(blocks, tokens)
    np.testing.assert_array_equal(np.asarray(got), whole[tokens])
    x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
    logits = jax.jit(lambda x, b: vocab_blocks.vocab_linear(x, b, native=native,
                                                         lanes=native))(x, blocks)
    assert logits.shape == (rows, 96) and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), x @ whole.T, rtol=1e-5, atol=1e-4)


def test_quantize_on_device_equals_host():
    w = _weight()
    for fmt in (QuantFormat(8, 0), QuantFormat(4, 32), QuantFormat(4, 32, True)):
        host = quantize(w, fmt)
        dev = jax.jit(lambda w, fmt=fmt: quantize(w, fmt, xp=jnp))(w)
        # XLA may divide by a reciprocal: scales within a float16 ulp, values at most a
        # rounding apart.
        np.testing.assert_allclose(np.asarray(dev["scale"], np.float32),
                                   host["scale"].astype(np.float32), rtol=2 ** -10)
        diff = np.abs(np.asarray(dev["q"]).astype(int) - host["q"])
        assert diff.max() <= 1 and diff.mean() < 1e-2


def test_zero_rows_quantize_to_zero():
    w = np.zeros((4, 64), np.float32)
    for fmt in (QuantFormat(8, 0), QuantFormat(4, 32), QuantFormat(4, 32, True)):
        parts = quantize(w, fmt)
        assert not parts["q"].any() and not parts["scale"].any()


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_w8a8_matmul_is_exact_in_integers_and_close_to_float(rows):
    w = _weight(40, 128)
    parts = quantize(w, quantization.scheme_format("w8a8"))
    x = np.random.default_rng(rows).standard_normal((rows, 128)).astype(np.float32)
    x[0, 3] = 9.0  # an outlier: its row's scale is 9 / 127
    got = np.asarray(jax.jit(lambda x, w: linear(x, w, int8_activations=True))(x, parts))
    # The int8 rows times the int8 weights, summed exactly, then the two scales ...
    xs = np.abs(x).max(-1, keepdims=True) / 127
    xq = np.clip(np.rint(x / xs), -127, 127)
    exact = (xq @ parts["q"].astype(np.float64).T) * xs * parts["scale"][:, 0].astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
    # ... within both quantization errors of the float product.
    want = x @ w.T
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.03


def test_w8a8_rows_do_not_depend_on_the_batch():
    # Each row is quantized on its own scale and summed exactly: a row's result is the same
    # bits alone (padded), beside others, or beside a zero row.
    parts = quantize(_weight(40, 128), quantization.scheme_format("w8a8"))
    x = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    x[2] = 0.0
    f = jax.jit(lambda x, w: linear(x, w, int8_activations=True))
    batch = np.asarray(f(x, parts))
    assert not batch[2].any()
    for i in range(6):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], parts))[0], batch[i])
    with pytest.raises(ValueError, match="per-channel int8"):
        linear(x, quantize(_weight(40, 128), QuantFormat(8, 32)), int8_activations=True)


def test_default_model_keeps_its_gguf_blocks(default_gguf):
    from models.loader import load_model, weight_bytes
    from models.registry import param_specs

    model = load_model(default_gguf, quantization="int8")
    quant = dict(model.quant)
    packed = model.native_matmuls  # on CPU with its kernel: 4-bit values two a byte
    # Q8_0 in the file: where the kernel multiplies bytes, in its order (uint8, plus 128)
    lanes8 = packed and native.multiplies_bytes()
    assert quant["embed"] == QuantFormat(8, 32, lanes=lanes8)
    assert model.embed[...].dtype == (jnp.uint8 if lanes8 else jnp.int8)
    assert quant["layers.w_up"] == QuantFormat(4, 32, True, packed=packed,  # Q4_1 in the file
                                               lanes=packed)
    assert model.layers.w_up[...].dtype == (jnp.uint8 if packed else jnp.int8)
    assert model.layers.w_up[...].shape == (30, 1536, 576 // (2 if packed else 1))
    assert model.layers.w_up_min[...].shape == (30, 1536, 576 // 32)
    # What the startup log reports: per value a byte (or half of one, packed) plus, per 32
    # values, a float16 scale (Q8_0) or a scale and a minimum (Q4_1); the norms stay float32.
    held, as_float32 = weight_bytes(nnx.to_pure_dict(nnx.state(model)), quant)
    specs = param_specs(model.cfg)
    assert as_float32 == 4 * sum(math.prod(s.shape) for s in specs.values())
    want = 0
    for name, spec in specs.items():
        n, fmt = math.prod(spec.shape), quant.get(name)
        want += 4 * n if fmt is None else (
            n // (2 if fmt.packed else 1) + n // 32 * 2 * (2 if fmt.has_min else 1))
    assert held == want
    assert held / as_float32 < (0.18 if packed else 0.28)


def test_default_model_int4_head_keeps_its_frequent_rows_in_8_bits(default_gguf):
    """Under int4 the file's Q8_0 head keeps its first FREQUENT_ROWS rows as they are; the rest
    are its values in int4 with minimums. The weights are then at most 16% of float32's."""
    from models.loader import load_model, weight_bytes

    model = load_model(default_gguf, quantization="int4")
    quant, top = dict(model.quant), model.top_params()
    rows = vocab_blocks.FREQUENT_ROWS
    lanes8 = model.native_matmuls and native.multiplies_bytes()
    assert quant["embed"] == QuantFormat(8, 32, lanes=lanes8)
    assert quant["embed_rare"] == QuantFormat(4, 32, True, packed=model.native_matmuls,
                                              lanes=model.native_matmuls)
    index = open_gguf(default_gguf)
    tensor = next(t for t in index.tensors if t.name == "token_embd.weight")
    file = repack(index.raw(tensor), tensor.tensor_type, tuple(reversed(tensor.shape)))
    got = np.asarray(top["embed"])
    if lanes8:
        got = quantization.from_lanes8(got, xp=np)
    np.testing.assert_array_equal(got, file["q"][:rows])
    np.testing.assert_array_equal(np.asarray(top["embed_scale"]), file["scale"][:rows])
    rest = dequantize(file["q"][rows:], file["scale"][rows:], xp=np)
    want = quantize(rest, QuantFormat(4, 32, True))
    got = np.asarray(top["embed_rare"])
    if model.native_matmuls:
        got = np.asarray(quantization.unpack(jnp.asarray(got), symmetric=False, lanes=True))
    np.testing.assert_array_equal(got, want["q"])
    np.testing.assert_array_equal(np.asarray(top["embed_rare_min"]), want["min"])
    held, as_float32 = weight_bytes(nnx.to_pure_dict(nnx.state(model)), dict(model.quant))
    if model.native_matmuls:  # 4-bit values two a byte (else one: see ops/quantization.py)
        assert held / as_float32 <= 0.16


def test_engine_offers_the_quantization_choices():
    from engine.config import QUANTIZATION_CHOICES

    assert QUANTIZATION_CHOICES == quantization.CHOICES


def test_quantization_plans(default_gguf, tmp_path):
    """auto keeps a GGUF's blocks of the types we hold (the default model's Q8_0/Q4_1) and
    nothing else; a scheme quantizes the rest
    (int4: the layers in 4 bits with minimums, the embedding / head's frequent rows in 8 and
    the others in 4); none is all float."""
    from tiny_models import save_tiny_hf

    from models.gguf_loader import load_gguf_params
    from models.hf_loader import load_hf_params
    from models.loader import load_config

    cfg = load_config(default_gguf)
    _, auto = load_gguf_params(default_gguf, cfg, jnp.float32, "auto")
    assert auto["embed"] == QuantFormat(8, 32) and auto["layers.wq"] == QuantFormat(4, 32, True)
    assert load_gguf_params(default_gguf, cfg, jnp.float32, "none")[1] == {}
    src = save_tiny_hf(tmp_path / "hf", tie_word_embeddings=False)
    tiny = load_config(src)
    assert load_hf_params(src, tiny, jnp.float32, "auto")[1] == {}
    int4 = load_hf_params(src, tiny, jnp.float32, "int4")[1]
    assert int4["layers.w_down"] == QuantFormat(4, 32, True)
    assert int4["embed"] == int4["lm_head"] == QuantFormat(8, 32)
    assert "embed_rare" not in int4  # 256 rows: too few to split
    _, gguf_int4 = load_gguf_params(default_gguf, cfg, jnp.float32, "int4")
    assert gguf_int4["embed"] == QuantFormat(8, 32)  # its frequent rows, the file's Q8_0
    assert gguf_int4["embed_rare"] == QuantFormat(4, 32, True)
    assert "embed_rare" not in auto
    int8 = load_hf_params(src, tiny, jnp.float32, "int8")[1]
    assert set(int8.values()) == {QuantFormat(8, 0)}
    # w8a8's matmuls need per-channel int8 everywhere: the file's blocks are requantized.
    _, w8a8 = load_gguf_params(default_gguf, cfg, jnp.float32, "w8a8")
    assert set(w8a8.values()) == {QuantFormat(8, 0, activations=8)}
    assert set(load_hf_params(src, tiny, jnp.float32, "w8a8")[1].values()) == {
        QuantFormat(8, 0, activations=8)}


def _as_held(scheme: str, model):
    """`--quantization scheme`'s format for wq as `model` holds it: 4 bits packed where its
    matmuls run in the CPU kernel (ops/cpu_linear.runs_native)."""
    fmt = quantization.scheme_format(scheme, "wq")
    return held_formats(model.dtype, {"wq": fmt}, sharded=False)["wq"]


@pytest.fixture
def small_frequent_rows(monkeypatch):
    """int4 splits the tiny models' 256-row vocabulary matrices: 64 frequent rows."""
    monkeypatch.setattr(vocab_blocks, "FREQUENT_ROWS", 64)


def test_quantized_checkpoint_round_trip(tmp_path, small_frequent_rows):
    from tiny_models import save_tiny_hf

    from models.convert import convert
    from models.generate import GreedyDecoder
    from models.loader import load_model

    src = save_tiny_hf(tmp_path / "hf", tie_word_embeddings=False)
    ids = [5, 17, 3, 99, 42, 7, 150, 23]
    for scheme in ("int8", "int4", "w8a8"):
        model = load_model(src, quantization=scheme)
        want = GreedyDecoder(model, max_len=64).prompt_logits(ids)
        ckpt = convert(src, tmp_path / scheme, quantization=scheme)
        model = load_model(ckpt)
        assert dict(model.quant)["layers.wq"] == _as_held(scheme, model)
        assert ("lm_head_rare" in dict(model.quant)) == (scheme == "int4")
        assert model.int8_activations == (scheme == "w8a8")
        np.testing.assert_array_equal(GreedyDecoder(model, max_len=64).prompt_logits(ids), want)
        with pytest.raises(ValueError, match="float weights"):
            load_model(convert(src, tmp_path / "float"), quantization=scheme)


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
def test_random_weights_quantize_on_the_device(scheme, small_frequent_rows):
    from models.presets import preset_config
    from models.weights import random_model

    model = random_model(preset_config("tiny"), jnp.float32, quantization=scheme)
    assert dict(model.quant)["layers.wq"] == _as_held(scheme, model)
    assert model.layers.wq[...].dtype == (jnp.uint8 if _as_held(scheme, model).packed
                                          else jnp.int8)
    assert model.layers.wq[...].any()
    if scheme == "int4":  # every part of the format, minimums included (they were left at 0)
        assert model.layers.wq_min[...].any()
        assert model.embed[...].shape[0] == 64 and model.embed_rare_min[...].any()


def test_materialized_counts_written_matrices_not_a_fusions_insides():
    """engine.bench.quantization.materialized (the kit's weight-copy count): a slice of the stack
    written by a fusion of the entry computation counts; the weight multiplied inside the
    fusion that sums it (one row on a GPU) writes nothing and does not."""
    from engine.bench.quantization import materialized
    from ops.xla_linear import row_sums
    w, x = jnp.ones((3, 96, 64), jnp.float32), jnp.ones((1, 64), jnp.float32)
    f = jax.jit(lambda x, w, i: row_sums(x, jax.lax.dynamic_index_in_dim(w, i, 0, False)))
    hlo = f.lower(x, w, 1).compile().as_text()
    assert "fused_computation" in hlo and " multiply(" in hlo  # the insides are in the text
    assert materialized(hlo, 96, 64) == 1  # XLA:CPU writes the slice, then sums it
    gpu_like = """HloModule m
%fused_reduce (param_0: bf16[32,96,64], param_1: s32[]) -> f32[1,96] {
  %ds = bf16[1,96,64]{2,1,0} dynamic-slice(%param_0, %param_1), dynamic_slice_sizes={1,96,64}
  %mul = f32[1,96,64]{2,1,0} multiply(%a, %b)
}
ENTRY %main (w: bf16[32,96,64], i: s32[]) -> f32[1,96] {
  %w = bf16[32,96,64]{2,1,0} parameter(0)
  ROOT %r = f32[1,96]{1,0} fusion(%w, %i), kind=kInput, calls=%fused_reduce
}
"""
    assert materialized(gpu_like, 96, 64) == 0
    assert materialized(gpu_like.replace("calls=%fused_reduce", "calls=%other"), 96, 64) == 2
