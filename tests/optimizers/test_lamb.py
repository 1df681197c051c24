"""Lamb: Adam directions rescaled per variable by a trust ratio."""

import functools
import re

import numpy as np
import optimizer_cases as cases
import pytest

import lossscale as ls
from lossscale.optimizers import Lamb
from lossscale.optimizers import lamb as lamb_module


class LambRule(cases.Rule):
    """You et al. (2019), Algorithm 2, with the identity scaling function."""

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def slots(self, w):
        return {"momentum": np.zeros_like(w), "velocity": np.zeros_like(w)}

    def step(self, g, w, s, lr, t):
        b1, b2 = self.beta_1, self.beta_2
        s["momentum"] = b1 * s["momentum"] + (1 - b1) * g
        s["velocity"] = b2 * s["velocity"] + (1 - b2) * g * g
        m_hat = s["momentum"] / (1 - b1 ** (t + 1))
        v_hat = s["velocity"] / (1 - b2 ** (t + 1))
        update = m_hat / (np.sqrt(v_hat) + self.epsilon)
        w_norm, u_norm = np.linalg.norm(w), np.linalg.norm(update)
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        return w - lr * ratio * update


VARIANTS = [{}, {"beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-5}]
CASES = [(None, {}), (0.05, {"clipvalue": 0.5})]


@pytest.mark.parametrize("options", VARIANTS, ids=["default", "custom_betas"])
@pytest.mark.parametrize("weight_decay,clip", CASES, ids=["no_decay", "decay_clipvalue"])
def test_matches_float64_reference(backend, options, weight_decay, clip):
    cases.check_reference(
        backend, functools.partial(Lamb, **options), LambRule(**options), 0.01, weight_decay, **clip
    )


def test_inside_loss_scale_optimizer(backend):
    cases.check_loss_scale(backend, Lamb, learning_rate=0.01, weight_decay=0.05, clipnorm=0.5)


def test_stateless_apply_matches_apply(backend):
    cases.check_stateless(backend, Lamb, learning_rate=0.01)


def test_jit_stateless_apply_matches_eager():
    cases.check_jit(Lamb, learning_rate=0.01, weight_decay=0.05)


def test_config_round_trip():
    cases.check_config_round_trip(
        Lamb, learning_rate=0.02, beta_1=0.8, beta_2=0.99, epsilon=1e-5, clipnorm=2.0
    )


def test_resumes_from_config_and_saved_variables(backend):
    cases.check_resume(backend, Lamb, learning_rate=0.01, global_clipnorm=1.0)


def test_zero_weights_take_the_plain_adam_step(backend):
    # norm(w) == 0: the trust ratio is 1, and nothing is inf or NaN.
    w = ls.Variable(backend.array(np.zeros(3, np.float32)), name="w")
    opt = Lamb(learning_rate=0.1)
    opt.apply([backend.array(np.array([1.0, -2.0, 0.0], np.float32))], [w])
    np.testing.assert_allclose(w.numpy(), [-0.1, 0.1, 0.0], rtol=1e-5)


def test_defaults_follow_keras():
    opt = Lamb()
    assert (opt.name, opt.beta_1, opt.beta_2, opt.epsilon) == ("lamb", 0.9, 0.999, 1e-7)
    assert float(opt.learning_rate) == pytest.approx(0.001)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"beta_1": 1.0}, "`beta_1` must be a finite number >= 0 and < 1. Received: beta_1=1.0"),
        ({"beta_2": -0.1}, "`beta_2` must be a finite number >= 0 and < 1. Received: beta_2=-0.1"),
        ({"epsilon": 0}, "`epsilon` must be a finite number > 0. Received: epsilon=0"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Lamb(**kwargs)


def test_docstring_example():
    cases.check_doctest(lamb_module)
