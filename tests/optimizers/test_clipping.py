"""Gradient clipping functions on every backend."""

import warnings

import numpy as np

from lossscale.backends import get_ops
from lossscale.optimizers import clipping


def test_clip_by_norm(backend):
    ops = get_ops(backend.name)
    g = backend.array(np.array([3.0, 4.0]))
    np.testing.assert_allclose(
        backend.numpy(clipping.clip_by_norm(ops, g, 1.0)), [0.6, 0.8], rtol=1e-6
    )
    np.testing.assert_allclose(
        backend.numpy(clipping.clip_by_norm(ops, g, 10.0)), [3, 4], rtol=1e-6
    )
    zero = backend.array(np.zeros(2))
    np.testing.assert_array_equal(backend.numpy(clipping.clip_by_norm(ops, zero, 1.0)), [0, 0])


def test_clip_by_global_norm(backend):
    ops = get_ops(backend.name)
    grads = [backend.array(np.array([3.0])), backend.array(np.array([4.0]))]
    out = clipping.clip_by_global_norm(ops, grads, 2.5)
    np.testing.assert_allclose([backend.numpy(g)[0] for g in out], [1.5, 2.0], rtol=1e-6)
    bad = clipping.clip_by_global_norm(ops, [backend.array(np.array([np.inf, 1.0]))], 1.0)
    assert np.isnan(backend.numpy(bad[0])).all()  # non-finite is not silently zeroed
    nan = clipping.clip_by_global_norm(ops, [backend.array(np.array([np.nan, 1.0]))], 1.0)
    assert np.isnan(backend.numpy(nan[0])).all()


def test_clipping_zero_gradients_is_silent_and_exact(backend):
    """An all-zero gradient is common (a frozen or dead unit): no warning, no change."""
    ops = get_ops(backend.name)
    zeros = [backend.array(np.zeros(3)), backend.array(np.zeros(2))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        by_global = clipping.clip_by_global_norm(ops, zeros, 0.5)
        by_norm = clipping.clip_by_norm(ops, zeros[0], 0.5)
    for out in by_global + [by_norm]:
        assert np.array_equal(backend.numpy(out), np.zeros_like(backend.numpy(out)))
    tiny = [backend.array(np.array([1e-30, -2e-30]))]  # norm far below the floor
    np.testing.assert_allclose(
        backend.numpy(clipping.clip_by_global_norm(ops, tiny, 0.5)[0]), [1e-30, -2e-30], rtol=1e-6
    )


def test_clip_gradients_dispatch(backend):
    ops = get_ops(backend.name)
    grads = [backend.array(np.array([-3.0, 0.5]))]
    np.testing.assert_array_equal(
        backend.numpy(clipping.clip_gradients(ops, grads, clipvalue=1.0)[0]), [-1, 0.5]
    )
    same = clipping.clip_gradients(ops, grads)
    assert same[0] is grads[0]
