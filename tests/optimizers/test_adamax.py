"""Adamax: two steps by hand; the shared scenarios are `test_rules.py`'s."""

import numpy as np

import lossscale as ls
from lossscale.optimizers import Adamax
from tests import optimizer_cases as cases


def test_two_steps_by_hand(backend):
    v = ls.Variable(backend.array(np.array([0.0])), name="w")
    opt = Adamax(0.1, beta_1=0.5, beta_2=0.5)
    opt.apply([backend.array(np.array([1.0]))], [v])
    # m = 0.5, u = 1, bias correction 0.5: a step of lr.
    np.testing.assert_allclose(backend.numpy(v), [-0.1], rtol=1e-6)
    opt.apply([backend.array(np.array([3.0]))], [v])
    # m = 1.75, u = max(0.5 * 1, 3) = 3, bias correction 0.75.
    got = cases.snapshot(opt, [v])
    np.testing.assert_allclose(got["w"], [-0.1 - 0.1 * 1.75 / (0.75 * 3)], rtol=1e-6)
    np.testing.assert_allclose(got["w_momentum"], [1.75], rtol=1e-6)
    np.testing.assert_allclose(got["w_norm"], [3.0], rtol=1e-6)
