"""Nadam: Adam with Nesterov momentum; its running product is optimizer state."""

import functools
import re

import numpy as np
import optimizer_cases as cases
import pytest

import lossscale as ls
from lossscale.optimizers import Nadam
from lossscale.optimizers import nadam as nadam_module


class NadamRule(cases.Rule):
    """Dozat (2016), with the momentum schedule u_t = beta_1 * (1 - 0.5 * 0.96**t)."""

    shared = ("u_product",)

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def slots(self, w):
        return {
            "momentum": np.zeros_like(w),
            "velocity": np.zeros_like(w),
            "u_product": np.float64(1.0),
        }

    def step(self, g, w, s, lr, t):
        b1, b2 = self.beta_1, self.beta_2
        u_t = b1 * (1 - 0.5 * 0.96 ** (t + 1))
        u_next = b1 * (1 - 0.5 * 0.96 ** (t + 2))
        s["u_product"] = s["u_product"] * u_t
        s["momentum"] = b1 * s["momentum"] + (1 - b1) * g
        s["velocity"] = b2 * s["velocity"] + (1 - b2) * g * g
        m_hat = u_next * s["momentum"] / (1 - s["u_product"] * u_next) + (1 - u_t) * g / (
            1 - s["u_product"]
        )
        v_hat = s["velocity"] / (1 - b2 ** (t + 1))
        return w - lr * m_hat / (np.sqrt(v_hat) + self.epsilon)


VARIANTS = [{}, {"beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-5}]
CASES = [(None, {}), (0.05, {"clipvalue": 0.5})]


@pytest.mark.parametrize("options", VARIANTS, ids=["default", "custom_betas"])
@pytest.mark.parametrize("weight_decay,clip", CASES, ids=["no_decay", "decay_clipvalue"])
def test_matches_float64_reference(backend, options, weight_decay, clip):
    cases.check_reference(
        backend,
        functools.partial(Nadam, **options),
        NadamRule(**options),
        0.01,
        weight_decay,
        **clip,
    )


def test_inside_loss_scale_optimizer(backend):
    # The skipped step must not advance `u_product` either: the comparison
    # covers every inner variable, `u_product` included.
    cases.check_loss_scale(backend, Nadam, learning_rate=0.01, weight_decay=0.05, clipnorm=0.5)


def test_stateless_apply_matches_apply(backend):
    cases.check_stateless(backend, Nadam, learning_rate=0.01)


def test_jit_stateless_apply_matches_eager():
    cases.check_jit(Nadam, learning_rate=0.01, global_clipnorm=1.0)


def test_config_round_trip():
    cases.check_config_round_trip(
        Nadam, learning_rate=0.02, beta_1=0.8, beta_2=0.99, epsilon=1e-5, clipvalue=1.0
    )


def test_resumes_from_config_and_saved_variables(backend):
    # Keras 3 loses `u_product` here; ours is saved and restored with the rest.
    cases.check_resume(backend, Nadam, learning_rate=0.01)


def test_u_product_is_a_variable_on_the_model_backend(backend):
    opt = Nadam()
    variables = cases.model_variables(backend, cases.weights())
    opt.build(variables)
    u_product = opt.variables[-1]
    assert (u_product.name, u_product.shape, u_product.dtype, u_product.backend) == (
        "u_product",
        (),
        "float32",
        backend.name,
    )
    assert float(u_product.numpy()) == 1.0


def test_u_product_advances_once_per_optimizer_step_with_accumulation(backend):
    opt = Nadam(learning_rate=0.01, gradient_accumulation_steps=2)
    variables = cases.model_variables(backend, cases.weights())
    grads = cases.gradients()
    for step_grads in grads[:4]:
        opt.apply([backend.array(g) for g in step_grads], variables)
    expected = 0.9 * (1 - 0.5 * 0.96) * 0.9 * (1 - 0.5 * 0.96**2)
    assert float(opt.variables[-1].numpy()) == pytest.approx(expected, rel=1e-6)


def test_defaults_follow_keras():
    opt = Nadam()
    assert (opt.name, opt.beta_1, opt.beta_2, opt.epsilon) == ("nadam", 0.9, 0.999, 1e-7)
    assert float(opt.learning_rate) == pytest.approx(0.001)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"beta_1": 1.2}, "`beta_1` must be a finite number >= 0 and < 1. Received: beta_1=1.2"),
        ({"beta_2": None}, "`beta_2` must be a finite number >= 0 and < 1. Received: beta_2=None"),
        ({"epsilon": -1.0}, "`epsilon` must be a finite number > 0. Received: epsilon=-1.0"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Nadam(**kwargs)


def test_wrapper_saves_u_product(backend):
    wrapped = ls.LossScaleOptimizer(Nadam(learning_rate=0.01))
    variables = cases.model_variables(backend, cases.weights())
    scale = float(wrapped.scale_loss(1.0))
    wrapped.apply([backend.array(g * scale) for g in cases.gradients()[0]], variables)
    store = {}
    wrapped.save_own_variables(store)
    assert float(store[str(len(store) - 1)]) == pytest.approx(0.9 * (1 - 0.5 * 0.96), rel=1e-6)


def test_docstring_example():
    cases.check_doctest(nadam_module)
