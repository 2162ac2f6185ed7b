"""ops/pallas_gpu_matmul: the layer's product read out of the stack (interpreted on CPU, and
lowered to Triton for CUDA from here)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.pallas_gpu_matmul import alike, block_sizes, fits, stacked_matmul, stacked_matmuls


def _case(layers, out_f, in_f, rows, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    stack = rng.standard_normal((layers, out_f, in_f)).astype(np.float32)
    x = rng.standard_normal((rows, in_f)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(stack, dtype)


@pytest.mark.parametrize("out_f,in_f,rows,splits", [
    (192, 576, 1, None),    # the default model's k/v shape, one row
    (96, 64, 5, None),      # blocks of 32, rows padded to 16
    (64, 512, 24, 4),       # split over the inputs, rows padded to 32
    (1024, 256, 64, None),  # few rows of many channels: the guessed splits
])
def test_matches_the_sliced_product(out_f, in_f, rows, splits):
    x, stack = _case(3, out_f, in_f, rows)
    for layer in (0, 2):
        want = np.asarray(x) @ np.asarray(stack[layer]).T
        got = stacked_matmul(x, stack, jnp.int32(layer), splits=splits)
        assert got.shape == (rows, out_f) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_int8_weights_with_per_channel_scales(rows):
    """Per-channel int8 converted in the read, each channel's sum times its scale: the
    product of the dequantized layer (one row as a multiply and a sum, more as a dot)."""
    from ops.quantization import QuantFormat, dequantize, quantize
    x, stack = _case(3, 128, 512, rows)
    parts = quantize(stack, QuantFormat(8, 0), xp=jnp)
    assert fits(x, parts["q"], parts["scale"])
    assert not fits(x, parts["q"])  # int8 needs its scales
    want = np.asarray(x) @ np.asarray(dequantize(parts["q"], parts["scale"]))[2].T
    got = stacked_matmul(x, parts["q"], 2, scale=parts["scale"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("out_f,in_f,rows,bits,group,has_min", [
    (128, 512, 1, 4, 32, True),    # --quantization int4 (Q4_1's format), one row
    (128, 512, 3, 4, 32, True),    # a drafting step's rows: dequantized for the dot
    (64, 256, 1, 4, 32, False),    # Q4_0: symmetric values stored plus 8
    (64, 256, 20, 4, 32, False),
    (64, 512, 2, 4, 64, True),     # a scale for two blocks of 32
    (96, 576, 1, 8, 32, False),    # Q8_0: int8 values in groups
    (96, 576, 5, 8, 32, False),
    (64, 512, 1, 4, 32, "int8"),   # 4-bit values one per int8 (not packed)
])
def test_group_formats_read_in_place(out_f, in_f, rows, bits, group, has_min):
    """Group formats, 4-bit values packed two a byte (ops/quantization.pack) or int8, each
    group's scale (and minimum) applied in the kernel: the product of the dequantized layer,
    with at most float32's rounding of a different order."""
    from ops.quantization import QuantFormat, dequantize, pack, quantize
    x, w = _case(3, out_f, in_f, rows, seed=rows)
    fmt = QuantFormat(bits, group, has_min=bool(has_min))
    parts = quantize(np.asarray(w), fmt)
    q = parts["q"] if bits == 8 or has_min == "int8" else pack(parts["q"], not fmt.has_min)
    q, scale = jnp.asarray(q), jnp.asarray(parts["scale"])
    minimum = jnp.asarray(parts["min"]) if "min" in parts else None
    assert q.dtype == (jnp.int8 if bits == 8 or has_min == "int8" else jnp.uint8)
    assert fits(x, q, scale, minimum)
    want = np.asarray(x) @ np.asarray(dequantize(q, scale, minimum))[2].T
    got = stacked_matmul(x, q, jnp.int32(2), scale=scale, minimum=minimum)
    assert got.shape == (rows, out_f)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_group_blocks_take_whole_groups():
    """A group format's block: whole groups, a power of two of them dividing the row's."""
    assert block_sizes(14336, 4096, 1, group=32, packed=True) == (64, 256, 2)  # 8 groups
    assert block_sizes(4096, 14336, 1, group=32, packed=True) == (64, 256, 4)  # 448 groups
    assert block_sizes(576, 576, 1, group=32, packed=True) == (64, 64, 1)     # 18 groups
    assert block_sizes(14336, 4096, 64, group=32, packed=True) == (64, 256, 2)
    assert block_sizes(1024, 4096, 1, group=32) == (64, 128, 8)   # int8 values: 4 groups
    x = jnp.zeros((1, 512), jnp.float32)
    q, scale = jnp.zeros((2, 64, 256), jnp.uint8), jnp.ones((2, 64, 16), jnp.float16)
    assert fits(x, q, scale) and not fits(x, q)           # packed values need their scales
    assert not fits(x, q, scale, jnp.ones((2, 64, 8), jnp.float16))  # minimums' shape
    assert not fits(x, q, jnp.ones((2, 64, 32), jnp.float16))  # packed groups of 16
    assert not fits(x, jnp.zeros((2, 64, 512), jnp.int8), jnp.ones((2, 64, 6), jnp.float16))
    with pytest.raises(ValueError, match="whole groups"):
        stacked_matmul(x, q, 0, scale=scale, block_k=96)


def test_bfloat16_weights_and_a_float32_result():
    x, stack = _case(2, 128, 256, 8, jnp.bfloat16)
    got = stacked_matmul(x, stack, 1, jnp.float32)
    want = np.asarray(x, np.float32) @ np.asarray(stack[1], np.float32).T
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-3)


def test_block_sizes_fill_the_gpu_by_splitting_the_inputs():
    assert block_sizes(14336, 4096) == (64, 128, 2)   # 224 blocks of channels
    assert block_sizes(1024, 4096) == (64, 128, 8)    # 16 blocks: split 8 ways
    assert block_sizes(576, 576) == (64, 64, 1)       # 9 steps: no even split
    assert block_sizes(14336, 4096, rows=1) == (64, 256, 2)  # one row: longer blocks
    assert block_sizes(100, 64) is None               # no block of 16 divides 100


def test_what_it_takes():
    x, stack = _case(2, 64, 64, 4)
    assert fits(x, stack)
    assert not fits(jnp.zeros((129, 64)), stack)              # more rows than MAX_ROWS
    assert not fits(x, stack.astype(jnp.int8))                # int8 without its scales
    assert not fits(x, jnp.zeros((2, 100, 64)))               # no block divides 100
    with pytest.raises(ValueError, match="float"):
        stacked_matmul(x, stack.astype(jnp.int4), 0)
    with pytest.raises(ValueError, match="do not divide"):
        stacked_matmul(x, stack, 0, block_n=128)


@pytest.mark.parametrize("rows,kind", [(64, "float"), (1, "float"), (8, "int8"), (1, "int8"),
                                       (1, "int4"), (8, "int4"), (1, "q8_0")])
def test_lowers_to_one_triton_kernel_for_cuda(rows, kind):
    x, stack = _case(4, 1024, 256, rows, jnp.bfloat16)
    scale = minimum = None
    if kind == "int8":
        stack, scale = stack.astype(jnp.int8), jnp.ones((4, 1024, 1), jnp.float16)
    elif kind == "int4":  # packed, groups of 32 with minimums
        stack, scale = jnp.zeros((4, 1024, 128), jnp.uint8), jnp.ones((4, 1024, 8), jnp.float16)
        minimum = scale
    elif kind == "q8_0":
        stack, scale = stack.astype(jnp.int8), jnp.ones((4, 1024, 8), jnp.float16)
    fn = jax.jit(lambda x, s, layer, c, m: stacked_matmul(x, s, layer, scale=c, minimum=m,
                                                          interpret=False))
    text = fn.trace(x, stack, jnp.int32(1), scale, minimum).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]


def test_linear_hands_a_gpu_its_group_formats(monkeypatch):
    """On a GPU (faked here), `linear` gives ops/pallas_gpu_matmul every group-format product
    (a layer of a stack at any row count, the int4 head's blocks as a stack of one) and
    float and per-channel int8 stacks from 2 rows; a model there holds its 4-bit matrices
    packed."""
    from ops import pallas_gpu_matmul, quantized_linear
    from ops.quantization import QuantFormat, pack, quantize
    from ops.quantized_linear import holds_packed, linear, linears, stacked

    calls, sizes = [], []

    def record(x, mats, layer, out_dtype=None):
        sizes.append(len(mats))
        for w in mats:
            calls.append((x.shape[0], w["stack"].shape, w["stack"].dtype, "min" in w))
        return [jnp.zeros((x.shape[0], w["stack"].shape[1]), out_dtype or x.dtype) for w in mats]

    _, w = _case(2, 64, 256, 1)
    int4 = quantize(np.asarray(w), QuantFormat(4, 32, has_min=True))
    int4["q"] = pack(int4["q"], False)
    int4 = {k: jnp.asarray(v) for k, v in int4.items()}
    per_channel = {k: jnp.asarray(v) for k, v in quantize(np.asarray(w), QuantFormat(8, 0)).items()}
    plan = {"layers.wq": QuantFormat(4, 32, has_min=True)}
    assert not holds_packed(jnp.bfloat16, plan, sharded=False)  # this CPU, bfloat16: no kernel
    monkeypatch.setattr(quantized_linear.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(pallas_gpu_matmul, "stacked_matmuls", record)
    assert holds_packed(jnp.bfloat16, plan, sharded=False)
    assert not holds_packed(jnp.bfloat16, plan, sharded=True)  # a mesh: XLA's products
    assert not holds_packed(jnp.bfloat16, {"w": QuantFormat(8, 0, activations=8)}, sharded=False)
    one, two = jnp.ones((1, 256)), jnp.ones((2, 256))
    for x in (one, two):
        linear(x, stacked(int4, jnp.int32(1)))
    linear(one, {k: v[0] for k, v in int4.items()})  # outside the stack: a stack of one
    assert calls == [(1, (2, 64, 128), jnp.uint8, True), (2, (2, 64, 128), jnp.uint8, True),
                     (1, (1, 64, 128), jnp.uint8, True)]
    calls.clear()
    linear(one, stacked(per_channel, jnp.int32(1)))  # one row: a multiply and a sum
    linear(two, {k: v[0] for k, v in per_channel.items()})  # outside the stack: XLA's dot
    assert calls == []
    linear(two, stacked(per_channel, jnp.int32(1)))
    assert calls == [(2, (2, 64, 256), jnp.int8, False)]
    # a layer's matrices of one kind (q, k and v) in one call; unlike ones one call each
    calls.clear(), sizes.clear()
    layer = jnp.int32(1)
    linears(one, [stacked(int4, layer)] * 3)
    assert sizes == [3]
    linears(two, [stacked(int4, layer), stacked(per_channel, layer)])
    assert sizes == [3, 1, 1]


@pytest.mark.parametrize("rows,kind", [(1, "int4"), (3, "int4"), (5, "float"), (2, "q8_0")])
def test_a_layers_matrices_in_one_call(rows, kind):
    """q, k and v (their own numbers of channels) in one kernel, the grid their blocks side
    by side: each the product of its own matrix; `linears` hands them over in one call on a
    GPU where they are alike."""
    from ops.quantization import QuantFormat, dequantize, pack, quantize
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 256)).astype(np.float32))
    mats, wants = [], []
    for out_f in (128, 64, 32):
        w = rng.standard_normal((2, out_f, 256)).astype(np.float32)
        if kind == "float":
            mats.append({"stack": jnp.asarray(w)})
            wants.append(np.asarray(x) @ w[1].T)
            continue
        fmt = QuantFormat(4, 32, has_min=True) if kind == "int4" else QuantFormat(8, 32)
        parts = quantize(w, fmt)
        q = pack(parts["q"], False) if kind == "int4" else parts["q"]
        mat = {"stack": jnp.asarray(q), "scale": jnp.asarray(parts["scale"])}
        if "min" in parts:
            mat["min"] = jnp.asarray(parts["min"])
        mats.append(mat)
        wants.append(np.asarray(x) @ np.asarray(dequantize(
            mat["stack"], mat["scale"], mat.get("min")))[1].T)
    other = {"stack": jnp.zeros((2, 64, 256), jnp.bfloat16)}
    assert alike(x, mats) and not alike(x, [mats[0], other])
    got = stacked_matmuls(x, mats, jnp.int32(1))
    for g, want in zip(got, wants, strict=True):
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-4)
    fn = jax.jit(lambda x, mats: stacked_matmuls(x, mats, 1, interpret=False))
    text = fn.trace(x.astype(jnp.bfloat16), mats).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]
