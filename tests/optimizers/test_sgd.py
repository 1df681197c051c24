"""SGD: exact values after known steps, on every backend; the shared scenarios: test_rules.py."""

import numpy as np

import lossscale as ls
from lossscale.optimizers import SGD


def run(backend, opt, grads, init=(1.0, -2.0)):
    v = ls.Variable(backend.array(np.array(init)), name="w")
    for g in grads:
        opt.apply([backend.array(np.array(g))], [v])
    return backend.numpy(v)


def test_plain(backend):
    np.testing.assert_allclose(
        run(backend, SGD(0.1), [[1.0, 1.0], [2.0, -1.0]]), [0.7, -2.0], rtol=1e-6
    )


def test_momentum(backend):
    # m1 = -0.1 * g1 = [-0.1, -0.1]; w = [0.9, -2.1]
    # m2 = 0.9 * m1 - 0.1 * g2 = [-0.29, -0.19]; w = [0.61, -2.29]
    got = run(backend, SGD(0.1, momentum=0.9), [[1.0, 1.0], [2.0, 1.0]])
    np.testing.assert_allclose(got, [0.61, -2.29], rtol=1e-6)


def test_nesterov(backend):
    # step 1: m = [-0.1, -0.1]; w += 0.9*m - 0.1*g = [-0.19, -0.19] -> [0.81, -2.19]
    got = run(backend, SGD(0.1, momentum=0.9, nesterov=True), [[1.0, 1.0]])
    np.testing.assert_allclose(got, [0.81, -2.19], rtol=1e-6)


def test_float16_variable(backend):
    v = ls.Variable(backend.array(np.array([1.0, 2.0]), dtype="float16"))
    SGD(0.5).apply([backend.array(np.array([1.0, 1.0]))], [v])
    assert v.dtype == "float16" and backend.numpy(v).tolist() == [0.5, 1.5]
