"""Adadelta: steps from the ratio of running update and gradient RMS."""

import functools
import re

import numpy as np
import optimizer_cases as cases
import pytest

from lossscale.optimizers import Adadelta
from lossscale.optimizers import adadelta as adadelta_module


class AdadeltaRule(cases.Rule):
    """Zeiler (2012), Algorithm 1, with Keras's extra learning-rate factor."""

    def __init__(self, rho=0.95, epsilon=1e-7):
        self.rho, self.epsilon = rho, epsilon

    def slots(self, w):
        return {"accumulated_grad": np.zeros_like(w), "accumulated_delta_var": np.zeros_like(w)}

    def step(self, g, w, s, lr, t):
        rho, eps = self.rho, self.epsilon
        s["accumulated_grad"] = rho * s["accumulated_grad"] + (1 - rho) * g * g
        delta = (
            -np.sqrt(s["accumulated_delta_var"] + eps) / np.sqrt(s["accumulated_grad"] + eps) * g
        )
        s["accumulated_delta_var"] = rho * s["accumulated_delta_var"] + (1 - rho) * delta * delta
        return w + lr * delta


VARIANTS = [{"epsilon": 1e-3}, {"rho": 0.5, "epsilon": 1e-2}]
CASES = [(None, {}), (0.05, {"clipnorm": 0.7})]


@pytest.mark.parametrize("options", VARIANTS, ids=["rho_default", "rho_half"])
@pytest.mark.parametrize("weight_decay,clip", CASES, ids=["no_decay", "decay_clipnorm"])
def test_matches_float64_reference(backend, options, weight_decay, clip):
    # A large learning rate: Adadelta's raw steps are of order sqrt(epsilon).
    cases.check_reference(
        backend,
        functools.partial(Adadelta, **options),
        AdadeltaRule(**options),
        1.0,
        weight_decay,
        **clip,
    )


def test_inside_loss_scale_optimizer(backend):
    cases.check_loss_scale(
        backend, Adadelta, learning_rate=1.0, epsilon=1e-3, weight_decay=0.05, global_clipnorm=1.0
    )


def test_stateless_apply_matches_apply(backend):
    cases.check_stateless(backend, Adadelta, learning_rate=1.0, epsilon=1e-3)


def test_jit_stateless_apply_matches_eager():
    cases.check_jit(Adadelta, learning_rate=1.0, epsilon=1e-3, clipvalue=0.5)


def test_config_round_trip():
    cases.check_config_round_trip(
        Adadelta, learning_rate=1.0, rho=0.9, epsilon=1e-6, weight_decay=0.01
    )


def test_resumes_from_config_and_saved_variables(backend):
    cases.check_resume(backend, Adadelta, learning_rate=1.0, epsilon=1e-3)


def test_defaults_follow_keras():
    opt = Adadelta()
    assert (opt.name, opt.rho, opt.epsilon) == ("adadelta", 0.95, 1e-7)
    assert float(opt.learning_rate) == pytest.approx(0.001)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"rho": 1.5}, "`rho` must be a finite number >= 0 and < 1. Received: rho=1.5"),
        ({"epsilon": 0.0}, "`epsilon` must be a finite number > 0. Received: epsilon=0.0"),
        ({"rho": True}, "`rho` must be a finite number >= 0 and < 1. Received: rho=True"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Adadelta(**kwargs)


def test_docstring_example():
    cases.check_doctest(adadelta_module)
