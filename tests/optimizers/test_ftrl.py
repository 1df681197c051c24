"""Ftrl: follow the regularized leader, with every regularization knob."""

import functools
import re

import numpy as np
import optimizer_cases as cases
import pytest

from lossscale.optimizers import Ftrl
from lossscale.optimizers import ftrl as ftrl_module


class FtrlRule(cases.Rule):
    """McMahan et al. (2013), Algorithm 1, generalised as Keras documents it.

    The learning-rate power replaces the paper's square root, `beta / (2 *
    lr)` joins the L2 term, and the shrinkage penalty's gradient `2 * s * w`
    is added to the gradient used for the linear term.
    """

    def __init__(
        self,
        learning_rate_power=-0.5,
        initial_accumulator_value=0.1,
        l1_regularization_strength=0.0,
        l2_regularization_strength=0.0,
        l2_shrinkage_regularization_strength=0.0,
        beta=0.0,
    ):
        self.power = -learning_rate_power
        self.initial = initial_accumulator_value
        self.l1, self.l2 = l1_regularization_strength, l2_regularization_strength
        self.shrinkage, self.beta = l2_shrinkage_regularization_strength, beta

    def slots(self, w):
        return {"accumulator": np.full_like(w, self.initial), "linear": np.zeros_like(w)}

    def step(self, g, w, s, lr, t):
        n, z = s["accumulator"], s["linear"]
        n_new = n + g * g
        sigma = (n_new**self.power - n**self.power) / lr
        z = z + g + 2 * self.shrinkage * w - sigma * w
        quadratic = n_new**self.power / lr + 2 * (self.l2 + self.beta / (2 * lr))
        s["accumulator"], s["linear"] = n_new, z
        return np.where(np.abs(z) <= self.l1, 0.0, (np.sign(z) * self.l1 - z) / quadratic)


REGULARIZED = {
    "learning_rate_power": -0.7,
    "initial_accumulator_value": 0.5,
    "l1_regularization_strength": 0.05,
    "l2_regularization_strength": 0.1,
    "l2_shrinkage_regularization_strength": 0.02,
    "beta": 0.3,
}
VARIANTS = [{}, REGULARIZED]
CASES = [(None, {}), (0.05, {"global_clipnorm": 1.5})]


@pytest.mark.parametrize("options", VARIANTS, ids=["default", "regularized"])
@pytest.mark.parametrize("weight_decay,clip", CASES, ids=["no_decay", "decay_global_clipnorm"])
def test_matches_float64_reference(backend, options, weight_decay, clip):
    cases.check_reference(
        backend, functools.partial(Ftrl, **options), FtrlRule(**options), 0.1, weight_decay, **clip
    )


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


def test_inside_loss_scale_optimizer(backend):
    cases.check_loss_scale(
        backend, Ftrl, learning_rate=0.1, weight_decay=0.05, clipnorm=0.5, **REGULARIZED
    )


def test_stateless_apply_matches_apply(backend):
    cases.check_stateless(backend, Ftrl, learning_rate=0.1, **REGULARIZED)


def test_jit_stateless_apply_matches_eager():
    cases.check_jit(Ftrl, learning_rate=0.1, clipvalue=0.5, **REGULARIZED)


def test_config_round_trip():
    cases.check_config_round_trip(Ftrl, learning_rate=0.1, weight_decay=0.01, **REGULARIZED)


def test_resumes_from_config_and_saved_variables(backend):
    cases.check_resume(backend, Ftrl, learning_rate=0.1, **REGULARIZED)


def test_defaults_follow_keras():
    opt = Ftrl()
    assert (
        opt.name,
        opt.learning_rate_power,
        opt.initial_accumulator_value,
        opt.l1_regularization_strength,
        opt.l2_regularization_strength,
        opt.l2_shrinkage_regularization_strength,
        opt.beta,
    ) == ("ftrl", -0.5, 0.1, 0.0, 0.0, 0.0, 0.0)
    assert float(opt.learning_rate) == pytest.approx(0.001)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"learning_rate_power": 0.5},
            "`learning_rate_power` must be a finite number <= 0. Received: learning_rate_power=0.5",
        ),
        (
            {"initial_accumulator_value": -1.0},
            "`initial_accumulator_value` must be a finite number >= 0. "
            "Received: initial_accumulator_value=-1.0",
        ),
        (
            {"l1_regularization_strength": -0.1},
            "`l1_regularization_strength` must be a finite number >= 0. "
            "Received: l1_regularization_strength=-0.1",
        ),
        (
            {"l2_regularization_strength": -0.1},
            "`l2_regularization_strength` must be a finite number >= 0. "
            "Received: l2_regularization_strength=-0.1",
        ),
        (
            {"l2_shrinkage_regularization_strength": -0.1},
            "`l2_shrinkage_regularization_strength` must be a finite number >= 0. "
            "Received: l2_shrinkage_regularization_strength=-0.1",
        ),
        ({"beta": -1.0}, "`beta` must be a finite number >= 0. Received: beta=-1.0"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Ftrl(**kwargs)


def test_docstring_example():
    cases.check_doctest(ftrl_module)
