"""Adamax: Adam with an exponentially weighted infinity norm."""

import functools
import re

import numpy as np
import optimizer_cases as cases
import pytest

from lossscale.optimizers import Adamax
from lossscale.optimizers import adamax as adamax_module


class AdamaxRule(cases.Rule):
    """Kingma & Ba (2014), section 7.1, with epsilon added to the norm."""

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def slots(self, w):
        return {"momentum": np.zeros_like(w), "norm": np.zeros_like(w)}

    def step(self, g, w, s, lr, t):
        s["momentum"] = self.beta_1 * s["momentum"] + (1 - self.beta_1) * g
        s["norm"] = np.maximum(self.beta_2 * s["norm"], np.abs(g))
        correction = 1 - self.beta_1 ** (t + 1)
        return w - lr * s["momentum"] / (correction * (s["norm"] + self.epsilon))


VARIANTS = [{}, {"beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-4}]
CASES = [(None, {}), (0.05, {"global_clipnorm": 1.5})]


@pytest.mark.parametrize("options", VARIANTS, ids=["default", "custom_betas"])
@pytest.mark.parametrize("weight_decay,clip", CASES, ids=["no_decay", "decay_global_clipnorm"])
def test_matches_float64_reference(backend, options, weight_decay, clip):
    cases.check_reference(
        backend,
        functools.partial(Adamax, **options),
        AdamaxRule(**options),
        0.01,
        weight_decay,
        **clip,
    )


def test_inside_loss_scale_optimizer(backend):
    cases.check_loss_scale(backend, Adamax, learning_rate=0.01, weight_decay=0.05, clipvalue=0.5)


def test_stateless_apply_matches_apply(backend):
    cases.check_stateless(backend, Adamax, learning_rate=0.01)


def test_jit_stateless_apply_matches_eager():
    cases.check_jit(Adamax, learning_rate=0.01, clipnorm=0.5)


def test_config_round_trip():
    cases.check_config_round_trip(
        Adamax, learning_rate=0.02, beta_1=0.5, beta_2=0.9, epsilon=1e-4, global_clipnorm=3.0
    )


def test_resumes_from_config_and_saved_variables(backend):
    cases.check_resume(backend, Adamax, learning_rate=0.01, weight_decay=0.1)


def test_defaults_follow_keras():
    opt = Adamax()
    assert (opt.name, opt.beta_1, opt.beta_2, opt.epsilon) == ("adamax", 0.9, 0.999, 1e-7)
    assert float(opt.learning_rate) == pytest.approx(0.001)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"beta_1": -0.1}, "`beta_1` must be a finite number >= 0 and < 1. Received: beta_1=-0.1"),
        ({"beta_2": 1}, "`beta_2` must be a finite number >= 0 and < 1. Received: beta_2=1"),
        ({"epsilon": float("inf")}, "`epsilon` must be a finite number > 0. Received: epsilon=inf"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Adamax(**kwargs)


def test_docstring_example():
    cases.check_doctest(adamax_module)
