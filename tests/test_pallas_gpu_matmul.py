"""ops/pallas_gpu_matmul: the layer's product read out of the stack (interpreted on CPU, and
lowered to Triton for CUDA from here)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.pallas_gpu_matmul import block_sizes, fits, stacked_matmul


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


@pytest.mark.parametrize("rows,int8", [(64, False), (1, False), (8, True), (1, True)])
def test_lowers_to_one_triton_kernel_for_cuda(rows, int8):
    x, stack = _case(4, 1024, 256, rows, jnp.bfloat16)
    scale = None
    if int8:
        stack, scale = stack.astype(jnp.int8), jnp.ones((4, 1024, 1), jnp.float16)
    fn = jax.jit(lambda x, s, layer, c: stacked_matmul(x, s, layer, scale=c, interpret=False))
    text = fn.trace(x, stack, jnp.int32(1), scale).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]
