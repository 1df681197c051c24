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


@pytest.mark.parametrize("mode", MODES)
def test_global_norm_matches_float64(mode):
    arrays = _arrays(4) + [np.ones(3, np.float16)]
    got = float(_run(mode, multi.global_norm, [tf.constant(a) for a in arrays]))
    expected = np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in arrays))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
