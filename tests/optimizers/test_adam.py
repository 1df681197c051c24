"""Adam: exact values after known steps, on every backend; the shared scenarios: test_rules.py."""

import math

import numpy as np
import pytest

import lossscale as ls
from lossscale.optimizers import Adam
from tests.reference import ReferenceOptimizer, adam_rule


def test_first_step_is_lr_times_sign(backend):
    v = ls.Variable(backend.array(np.array([1.0, 1.0])))
    Adam(0.1, epsilon=1e-12).apply([backend.array(np.array([0.5, -3.0]))], [v])
    np.testing.assert_allclose(backend.numpy(v), [0.9, 1.1], rtol=1e-6)


def test_two_steps_by_hand(backend):
    v = ls.Variable(backend.array(np.array([0.0])))
    opt = Adam(0.1, beta_1=0.5, beta_2=0.5, epsilon=0.0 + 1e-30)
    opt.apply([backend.array(np.array([1.0]))], [v])
    opt.apply([backend.array(np.array([3.0]))], [v])
    # m = 0.5, v = 0.5 after step 1; m = 1.75, v = 4.75 after step 2.
    alpha = 0.1 * math.sqrt(1 - 0.25) / (1 - 0.25)
    expected = -0.1 - 1.75 * alpha / math.sqrt(4.75)
    np.testing.assert_allclose(backend.numpy(v), [expected], rtol=1e-6)
    np.testing.assert_allclose(backend.numpy(opt._momentums[0]), [1.75], rtol=1e-6)
    np.testing.assert_allclose(backend.numpy(opt._velocities[0]), [4.75], rtol=1e-6)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_random_against_reference(backend, rng, amsgrad):
    init = rng.normal(size=(5, 3)).astype(np.float32)
    v = ls.Variable(backend.array(init))
    opt = Adam(0.01, amsgrad=amsgrad)
    ref = ReferenceOptimizer(adam_rule(amsgrad=amsgrad), [init], lr=0.01)
    for i in range(6):
        g = (rng.normal(size=(5, 3)) * (3.0 if i == 3 else 1.0)).astype(np.float32)
        opt.apply([backend.array(g)], [v])
        ref.apply([g])
        np.testing.assert_allclose(backend.numpy(v), ref.w[0], rtol=1e-5, atol=1e-6)
    assert len(opt.variables) == 2 + (3 if amsgrad else 2)
    assert [x.name for x in opt.variables[2:4]] == ["variable_momentum", "variable_velocity"]
