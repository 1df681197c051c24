"""Gradient clipping functions on every backend."""

import numpy as np

from lossscale.backends import get_ops
from lossscale.optimizers import clipping


def test_clip_by_norm(backend):
    ops = get_ops(backend.name)
    g = backend.array(np.array([3.0, 4.0]))
    np.testing.assert_allclose(backend.numpy(clipping.clip_by_norm(ops, g, 1.0)), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(backend.numpy(clipping.clip_by_norm(ops, g, 10.0)), [3, 4], rtol=1e-6)
    zero = backend.array(np.zeros(2))
    np.testing.assert_array_equal(backend.numpy(clipping.clip_by_norm(ops, zero, 1.0)), [0, 0])


def test_clip_by_global_norm(backend):
    ops = get_ops(backend.name)
    grads = [backend.array(np.array([3.0])), backend.array(np.array([4.0]))]
    out = clipping.clip_by_global_norm(ops, grads, 2.5)
    np.testing.assert_allclose([backend.numpy(g)[0] for g in out], [1.5, 2.0], rtol=1e-6)
    bad = clipping.clip_by_global_norm(ops, [backend.array(np.array([np.inf, 1.0]))], 1.0)
    assert np.isnan(backend.numpy(bad[0])).all()  # non-finite is not silently zeroed


def test_clip_gradients_dispatch(backend):
    ops = get_ops(backend.name)
    grads = [backend.array(np.array([-3.0, 0.5]))]
    np.testing.assert_array_equal(backend.numpy(clipping.clip_gradients(ops, grads, clipvalue=1.0)[0]), [-1, 0.5])
    same = clipping.clip_gradients(ops, grads)
    assert same[0] is grads[0]
