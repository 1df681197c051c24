"""Lamb: the trust ratio at zero weights; the shared scenarios are `test_rules.py`'s."""

import numpy as np

import lossscale as ls
from lossscale.optimizers import Lamb


def test_zero_weights_take_the_plain_adam_step(backend):
    # norm(w) == 0: the trust ratio is 1, and nothing is inf or NaN.
    w = ls.Variable(backend.array(np.zeros(3, np.float32)), name="w")
    opt = Lamb(learning_rate=0.1)
    opt.apply([backend.array(np.array([1.0, -2.0, 0.0], np.float32))], [w])
    np.testing.assert_allclose(w.numpy(), [-0.1, 0.1, 0.0], rtol=1e-5)
