"""RMSprop: plain, with momentum, and centered."""

import functools
import re

import numpy as np
import optimizer_cases as cases
import pytest

from lossscale.optimizers import RMSprop
from lossscale.optimizers import rmsprop as rmsprop_module


class RMSpropRule(cases.Rule):
    """Hinton (2012), lecture 6e; Keras's placement of epsilon inside the root."""

    def __init__(self, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False):
        self.rho, self.momentum, self.epsilon, self.centered = rho, momentum, epsilon, centered

    def slots(self, w):
        names = (
            ["velocity"]
            + (["momentum"] if self.momentum > 0 else [])
            + (["average_gradient"] if self.centered else [])
        )
        return {name: np.zeros_like(w) for name in names}

    def step(self, g, w, s, lr, t):
        s["velocity"] = self.rho * s["velocity"] + (1 - self.rho) * g * g
        denominator = s["velocity"] + self.epsilon
        if self.centered:
            s["average_gradient"] = self.rho * s["average_gradient"] + (1 - self.rho) * g
            denominator = denominator - s["average_gradient"] ** 2
        increment = lr * g / np.sqrt(denominator)
        if self.momentum > 0:
            s["momentum"] = self.momentum * s["momentum"] + increment
            return w - s["momentum"]
        return w - increment


VARIANTS = [{}, {"rho": 0.8, "momentum": 0.9, "centered": True}]
CASES = [(None, {}), (0.05, {"clipvalue": 0.5})]


@pytest.mark.parametrize("options", VARIANTS, ids=["default", "centered_momentum"])
@pytest.mark.parametrize("weight_decay,clip", CASES, ids=["no_decay", "decay_clipvalue"])
def test_matches_float64_reference(backend, options, weight_decay, clip):
    cases.check_reference(
        backend,
        functools.partial(RMSprop, **options),
        RMSpropRule(**options),
        0.01,
        weight_decay,
        **clip,
    )


def test_inside_loss_scale_optimizer(backend):
    cases.check_loss_scale(
        backend,
        RMSprop,
        learning_rate=0.01,
        weight_decay=0.05,
        clipnorm=0.5,
        momentum=0.5,
        centered=True,
    )


def test_stateless_apply_matches_apply(backend):
    cases.check_stateless(backend, RMSprop, learning_rate=0.01, momentum=0.5, centered=True)


def test_jit_stateless_apply_matches_eager():
    cases.check_jit(RMSprop, learning_rate=0.01, momentum=0.5, centered=True, global_clipnorm=1.0)


def test_config_round_trip():
    cases.check_config_round_trip(
        RMSprop,
        learning_rate=0.02,
        rho=0.8,
        momentum=0.5,
        epsilon=1e-6,
        centered=True,
        weight_decay=0.01,
    )


def test_resumes_from_config_and_saved_variables(backend):
    cases.check_resume(backend, RMSprop, learning_rate=0.01, momentum=0.5, centered=True)


def test_slots_follow_options():
    w = cases.weights()
    assert [v.name for v in _built(RMSprop(), w).variables] == [
        "iteration",
        "learning_rate",
        "param_0_velocity",
        "param_1_velocity",
    ]
    names = [v.name for v in _built(RMSprop(momentum=0.5, centered=True), w).variables]
    # Keras's order: all velocities, then all momentums, then all averages.
    assert names[2:] == [
        "param_0_velocity",
        "param_1_velocity",
        "param_0_momentum",
        "param_1_momentum",
        "param_0_average_gradient",
        "param_1_average_gradient",
    ]


def _built(optimizer, w):
    optimizer.build(w)
    return optimizer


def test_defaults_follow_keras():
    opt = RMSprop()
    assert (opt.name, opt.rho, opt.momentum, opt.epsilon, opt.centered) == (
        "rm_sprop",
        0.9,
        0.0,
        1e-7,
        False,
    )
    assert float(opt.learning_rate) == pytest.approx(0.001)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"rho": 1.0}, "`rho` must be a finite number >= 0 and < 1. Received: rho=1.0"),
        ({"rho": -0.1}, "`rho` must be a finite number >= 0 and < 1. Received: rho=-0.1"),
        (
            {"momentum": -0.5},
            "`momentum` must be a finite number >= 0 and <= 1. Received: momentum=-0.5",
        ),
        ({"epsilon": -1e-7}, "`epsilon` must be a finite number > 0. Received: epsilon=-1e-07"),
        ({"centered": 1}, "`centered` must be a boolean. Received: centered=1"),
        (
            {"learning_rate": float("nan")},
            "`learning_rate` must be a finite number >= 0. Received: learning_rate=nan",
        ),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RMSprop(**kwargs)


def test_docstring_example():
    cases.check_doctest(rmsprop_module)
