"""Unscale, finite check and norms over lists of tensors: eager, in a graph, under XLA.

XLA's CPU max-reduction drops NaN, so the checks are written not to rely
on it; each runs eagerly, in a `tf.function` and with `jit_compile=True`,
on lists shorter and longer than `compiled.MIN_TENSORS` (the eager
helpers trace a long list once).
"""

import numpy as np
import pytest
import tensorflow as tf

from lossscale.backends.tensorflow import compiled, multi

MODES = ["eager", "graph", "xla"]
COUNTS = [2, compiled.MIN_TENSORS + 1]


def _run(mode, fn, *args):
    if mode == "eager":
        return fn(*args)
    return tf.function(fn, jit_compile=mode == "xla")(*args)


def _arrays(count, bad=None, dtype=np.float32):
    rng = np.random.default_rng(count)
    arrays = [rng.normal(size=(7, 5)).astype(dtype) for _ in range(count)]
    if bad is not None:
        arrays[-1][3, 2] = bad
    return arrays


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("mode", MODES)
def test_finite_checks_find_inf_and_nan(mode, count):
    for bad, finite in [(None, True), (np.inf, False), (-np.inf, False), (np.nan, False)]:
        tensors = [tf.constant(a) for a in _arrays(count, bad)]
        flag, skip = _run(mode, compiled.finite_flags, tensors)
        assert bool(flag) is finite and float(skip) == float(not finite), (mode, bad)
        assert bool(_run(mode, compiled.all_finite, tensors)) is finite


@pytest.mark.parametrize("mode", MODES)
def test_max_abs_propagates_nan_where_xla_would_drop_it(mode):
    arrays = _arrays(3)
    tensors = [tf.constant(a) for a in arrays]
    expected = max(np.abs(a).max() for a in arrays)
    assert float(_run(mode, multi.max_abs, tensors)) == expected
    with_nan = [tf.constant(a) for a in _arrays(3, np.nan)]
    assert np.isnan(float(_run(mode, multi.max_abs, with_nan)))
    if mode == "xla":  # the reason for the explicit NaN test
        assert not np.isnan(float(_run(mode, lambda ts: tf.reduce_max(ts[-1]), with_nan)))


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("mode", MODES)
def test_unscale_divides_half_gradients_in_float32(mode, count):
    arrays = _arrays(count, dtype=np.float16)
    out = _run(mode, compiled.unscale, [tf.constant(a) for a in arrays], tf.constant(8.0))
    for got, a in zip(out, arrays):
        assert got.dtype == tf.float32
        np.testing.assert_array_equal(got.numpy(), a.astype(np.float32) / np.float32(8.0))


def _sparse(rng, rows, dtype=np.float32):
    """An embedding's gradient: 2,000 looked-up rows (many repeated) of a 50,000 x 64 table."""
    indices = rng.integers(0, 50_000, size=rows).astype(np.int32)
    indices[: rows // 2] = rng.integers(0, 30, size=rows // 2)  # repeats
    values = rng.normal(size=(rows, 64)).astype(dtype)
    return indices, values


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_sparse_gradient_stays_sparse_its_checks_read_it_dense(mode, count):
    rng = np.random.default_rng(4)
    indices, values = _sparse(rng, 2000, np.float16)
    dense = [tf.constant(a) for a in _arrays(count - 1)]

    def unscaled(values, indices):
        sparse = tf.IndexedSlices(values, indices, tf.constant([50_000, 64]))
        out = compiled.unscale([sparse, *dense], tf.constant(8.0))
        assert isinstance(out[0], tf.IndexedSlices)
        return out[0].values, out[0].indices

    got, got_indices = _run(mode, unscaled, tf.constant(values), tf.constant(indices))
    assert got.dtype == tf.float32
    np.testing.assert_array_equal(got.numpy(), values.astype(np.float32) / np.float32(8.0))
    np.testing.assert_array_equal(got_indices.numpy(), indices)

    # One bad value at the first, the last and a random place of the values.
    def flags(values, indices):
        sparse = tf.IndexedSlices(values, indices, tf.constant([50_000, 64]))
        return compiled.finite_flags([*dense, sparse])[0]

    check = flags if mode == "eager" else tf.function(flags, jit_compile=mode == "xla")
    for position in [(0, 0), (1999, 63), tuple(rng.integers(0, [2000, 64]))]:
        for bad in (np.inf, -np.inf, np.nan, None):
            broken = values.astype(np.float32)
            if bad is not None:
                broken[position] = bad
            finite = check(tf.constant(broken), tf.constant(indices))
            assert bool(finite) is (bad is None), (position, bad)
    # Checked dense: two finite values of one repeated row that sum past float32.
    huge = np.full((2, 64), 3e38, np.float32)

    def repeated(values):
        return compiled.all_finite([tf.IndexedSlices(values, tf.constant([5, 5]), [10, 64])])

    assert not bool(_run(mode, repeated, tf.constant(huge)))


@pytest.mark.parametrize("mode", MODES)
def test_global_norm_matches_float64(mode):
    arrays = _arrays(4) + [np.ones(3, np.float16)]
    got = float(_run(mode, multi.global_norm, [tf.constant(a) for a in arrays]))
    expected = np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in arrays))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
