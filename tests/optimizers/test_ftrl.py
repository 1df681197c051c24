"""Ftrl: L1 sparsity and a fixed rate; the shared scenarios are `test_rules.py`'s."""

import functools

import numpy as np

from lossscale.optimizers import Ftrl
from tests import optimizer_cases as cases
from tests.optimizer_table import FtrlRule


def test_l1_keeps_small_linear_terms_at_zero(backend):
    w = cases.model_variables(backend, [np.zeros(4, np.float32)])
    opt = Ftrl(learning_rate=1.0, initial_accumulator_value=0.0, l1_regularization_strength=0.5)
    opt.apply([backend.array(np.array([2.0, 0.25, -0.5, -4.0], np.float32))], w)
    np.testing.assert_allclose(w[0].numpy(), [-0.75, 0.0, 0.0, 0.875], rtol=1e-6)


def test_zero_learning_rate_power_is_a_fixed_rate(backend):
    cases.check_reference(
        backend,
        functools.partial(Ftrl, learning_rate_power=0.0),
        FtrlRule(learning_rate_power=0.0),
        0.1,
    )
