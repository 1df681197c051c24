"""Adagrad: accumulated squared gradients scale each step."""

import functools
import re

import numpy as np
import optimizer_cases as cases
import pytest

from lossscale.optimizers import Adagrad
from lossscale.optimizers import adagrad as adagrad_module


class AdagradRule(cases.Rule):
    """Duchi, Hazan & Singer (2011), diagonal form, epsilon inside the root."""

    def __init__(self, initial_accumulator_value=0.1, epsilon=1e-7):
        self.initial, self.epsilon = initial_accumulator_value, epsilon

    def slots(self, w):
        return {"accumulator": np.full_like(w, self.initial)}

    def step(self, g, w, s, lr, t):
        s["accumulator"] = s["accumulator"] + g * g
        return w - lr * g / np.sqrt(s["accumulator"] + self.epsilon)


VARIANTS = [{}, {"initial_accumulator_value": 0.0, "epsilon": 1e-3}]
CASES = [(None, {}), (0.05, {"global_clipnorm": 1.5})]


@pytest.mark.parametrize("options", VARIANTS, ids=["default", "zero_accumulator"])
@pytest.mark.parametrize("weight_decay,clip", CASES, ids=["no_decay", "decay_global_clipnorm"])
def test_matches_float64_reference(backend, options, weight_decay, clip):
    cases.check_reference(
        backend,
        functools.partial(Adagrad, **options),
        AdagradRule(**options),
        0.1,
        weight_decay,
        **clip,
    )


def test_inside_loss_scale_optimizer(backend):
    cases.check_loss_scale(backend, Adagrad, learning_rate=0.1, weight_decay=0.05, clipvalue=0.5)


def test_stateless_apply_matches_apply(backend):
    cases.check_stateless(backend, Adagrad, learning_rate=0.1)


def test_jit_stateless_apply_matches_eager():
    cases.check_jit(Adagrad, learning_rate=0.1, weight_decay=0.05)


def test_config_round_trip():
    cases.check_config_round_trip(
        Adagrad, learning_rate=0.5, initial_accumulator_value=0.5, epsilon=1e-5, clipvalue=2.0
    )


def test_resumes_from_config_and_saved_variables(backend):
    cases.check_resume(backend, Adagrad, learning_rate=0.1, initial_accumulator_value=0.2)


def test_defaults_follow_keras():
    opt = Adagrad()
    assert (opt.name, opt.initial_accumulator_value, opt.epsilon) == ("adagrad", 0.1, 1e-7)
    assert float(opt.learning_rate) == pytest.approx(0.001)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"initial_accumulator_value": -0.1},
            "`initial_accumulator_value` must be a finite number >= 0. "
            "Received: initial_accumulator_value=-0.1",
        ),
        ({"epsilon": 0}, "`epsilon` must be a finite number > 0. Received: epsilon=0"),
        (
            {"learning_rate": "fast"},
            "`learning_rate` must be a finite number >= 0. Received: learning_rate='fast'",
        ),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Adagrad(**kwargs)


def test_docstring_example():
    cases.check_doctest(adagrad_module)
