"""ops/invariant.py: a row's sum is the same bits whatever else shares its array, which
XLA's own reduction does not promise (on XLA:CPU it changes between 4 and 8 rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import rms_norm
from ops.invariant import DEVICE_LANES, LANES, _row_sum, mean_square, row_sum

ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 64, 512)


@pytest.mark.parametrize("width", [64, 100, 576, 1536])
def test_a_rows_sum_does_not_depend_on_the_other_rows(width):
    rng = np.random.default_rng(width)
    x = rng.standard_normal((max(ROWS), width)).astype(np.float32)
    f = jax.jit(row_sum)
    want = np.asarray(f(jnp.asarray(x[:1])))[0]
    np.testing.assert_allclose(want, x[0].astype(np.float64).sum(), rtol=1e-5, atol=1e-5)
    for rows in ROWS:
        for start in (0, 3):  # the row alone, first, and among others
            block = np.roll(x, -start, 0)[:rows].copy()
            block[min(start, rows - 1)] = x[0]
            got = np.asarray(f(jnp.asarray(block)))[min(start, rows - 1)]
            assert got.tobytes() == want.tobytes(), (rows, start)


def test_rms_norm_of_a_row_is_the_same_bits_in_any_batch():
    rng = np.random.default_rng(0)
    row = rng.standard_normal((1, 576)).astype(np.float32)
    weight = jnp.asarray(rng.standard_normal(576).astype(np.float32))
    f = jax.jit(lambda x: rms_norm(x, weight, 1e-5))
    want = np.asarray(f(jnp.asarray(row)))[0]
    for rows in ROWS:
        x = rng.standard_normal((rows, 576)).astype(np.float32)
        x[rows // 2] = row[0]
        assert np.asarray(f(jnp.asarray(x)))[rows // 2].tobytes() == want.tobytes(), rows
    ref = row[0] / np.sqrt(np.mean(row[0].astype(np.float64) ** 2) + 1e-5) * np.asarray(weight)
    np.testing.assert_allclose(want, ref, rtol=1e-5, atol=1e-6)


def test_mean_square_matches_numpy_on_leading_dimensions():
    x = np.random.default_rng(1).standard_normal((3, 9, 64)).astype(np.float32)
    got = np.asarray(jax.jit(mean_square)(jnp.asarray(x)))
    assert got.shape == (3, 9, 1)
    np.testing.assert_allclose(got[..., 0], np.mean(x.astype(np.float64) ** 2, -1), rtol=1e-6)


def _numpy_order(x: np.ndarray, lanes: int) -> np.float32:
    """`row_sum`'s order written out in float32: the lanes' pieces one after another, then
    the tree."""
    x = np.pad(x, (0, -len(x) % lanes)).reshape(-1, lanes)
    acc = x[0].copy()
    for piece in x[1:]:
        acc = (acc + piece).astype(np.float32)
    while len(acc) > 1:
        acc = (acc[:len(acc) // 2] + acc[len(acc) // 2:]).astype(np.float32)
    return acc[0]


@pytest.mark.parametrize("lanes", [LANES, DEVICE_LANES])
@pytest.mark.parametrize("width", [100, 576, 4096])
def test_each_platforms_order_is_the_written_one_in_any_batch(lanes, width):
    # The CPU's 16 lanes and a GPU's 128 (its form, run here): the bits of the order
    # written out in numpy, for a row alone or among others.
    x = np.random.default_rng(width).standard_normal((9, width)).astype(np.float32)
    f = jax.jit(lambda x: _row_sum(x, lanes, lanes == DEVICE_LANES))
    for rows in (1, 4, 9):
        got = np.asarray(f(jnp.asarray(x[:rows])))[:, 0]
        for r in range(rows):
            assert got[r].tobytes() == _numpy_order(x[r], lanes).tobytes(), (rows, r)
    if lanes == LANES:  # what row_sum runs on this CPU
        np.testing.assert_array_equal(np.asarray(jax.jit(row_sum)(jnp.asarray(x)))[:, 0],
                                      np.asarray(f(jnp.asarray(x)))[:, 0])


def test_a_gpu_sums_in_device_lanes():
    x = jax.ShapeDtypeStruct((2, 576), jnp.float32)
    text = {p: jax.jit(row_sum).trace(x).lower(lowering_platforms=(p,)).as_text()
            for p in ("cpu", "cuda")}
    assert f"tensor<2x5x{DEVICE_LANES}xf32>" in text["cuda"]  # 576 padded to 640
    assert f"tensor<2x36x{LANES}xf32>" in text["cpu"]
    assert "optimization_barrier" in text["cuda"] and "optimization_barrier" not in text["cpu"]
