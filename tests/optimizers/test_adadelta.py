"""Adadelta: one step by hand; the shared scenarios are `test_rules.py`'s."""

import numpy as np

import lossscale as ls
from lossscale.optimizers import Adadelta
from tests import optimizer_cases as cases


def test_one_step_by_hand(backend):
    # E[g^2] = 0.5 * 2^2 = 2; delta = -sqrt(0 + 0.25) / sqrt(2 + 0.25) * 2 = -2/3;
    # E[dx^2] = 0.5 * (2/3)^2.
    v = ls.Variable(backend.array(np.array([1.0])), name="w")
    opt = Adadelta(1.0, rho=0.5, epsilon=0.25)
    opt.apply([backend.array(np.array([2.0]))], [v])
    got = cases.snapshot(opt, [v])
    np.testing.assert_allclose(got["w"], [1 / 3], rtol=1e-6)
    np.testing.assert_allclose(got["w_accumulated_grad"], [2.0], rtol=1e-6)
    np.testing.assert_allclose(got["w_accumulated_delta_var"], [2 / 9], rtol=1e-6)
