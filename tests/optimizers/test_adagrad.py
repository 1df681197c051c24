"""Adagrad: two steps by hand; the shared scenarios are `test_rules.py`'s."""

import numpy as np

import lossscale as ls
from lossscale.optimizers import Adagrad
from tests import optimizer_cases as cases


def test_two_steps_by_hand(backend):
    # Accumulators 9 then 25: steps of 0.1 * 3 / 3 and 0.1 * 4 / 5.
    v = ls.Variable(backend.array(np.array([1.0])), name="w")
    opt = Adagrad(0.1, initial_accumulator_value=0.0)
    opt.apply([backend.array(np.array([3.0]))], [v])
    np.testing.assert_allclose(backend.numpy(v), [0.9], rtol=1e-6)
    opt.apply([backend.array(np.array([4.0]))], [v])
    got = cases.snapshot(opt, [v])
    np.testing.assert_allclose(got["w"], [0.82], rtol=1e-6)
    np.testing.assert_allclose(got["w_accumulator"], [25.0], rtol=1e-6)
