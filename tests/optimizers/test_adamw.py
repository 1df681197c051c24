"""AdamW: Adam's rule with decoupled weight decay on by default."""

import functools
import math
import re

import numpy as np
import optimizer_cases as cases
import pytest

from lossscale.optimizers import Adam, AdamW
from lossscale.optimizers import adamw as adamw_module


class AdamRule(cases.Rule):
    """Kingma & Ba (2014), with the "epsilon hat" form and optional AMSGrad."""

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False):
        self.beta_1, self.beta_2, self.epsilon, self.amsgrad = beta_1, beta_2, epsilon, amsgrad

    def slots(self, w):
        names = ["momentum", "velocity"] + (["velocity_hat"] if self.amsgrad else [])
        return {name: np.zeros_like(w) for name in names}

    def step(self, g, w, s, lr, t):
        b1, b2 = self.beta_1, self.beta_2
        s["momentum"] = b1 * s["momentum"] + (1 - b1) * g
        s["velocity"] = b2 * s["velocity"] + (1 - b2) * g * g
        v = s["velocity"]
        if self.amsgrad:
            s["velocity_hat"] = np.maximum(s["velocity_hat"], v)
            v = s["velocity_hat"]
        alpha = lr * math.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1))
        return w - alpha * s["momentum"] / (np.sqrt(v) + self.epsilon)


VARIANTS = [{}, {"beta_1": 0.8, "beta_2": 0.99, "amsgrad": True}]
CASES = [(0.0, {}), (0.05, {"clipnorm": 0.5})]


@pytest.mark.parametrize("options", VARIANTS, ids=["default", "amsgrad"])
@pytest.mark.parametrize("weight_decay,clip", CASES, ids=["no_decay", "decay_clipnorm"])
def test_matches_float64_reference(backend, options, weight_decay, clip):
    cases.check_reference(
        backend,
        functools.partial(AdamW, **options),
        AdamRule(**options),
        0.01,
        weight_decay,
        **clip,
    )


def test_inside_loss_scale_optimizer(backend):
    cases.check_loss_scale(
        backend, AdamW, learning_rate=0.01, weight_decay=0.05, global_clipnorm=1.0, amsgrad=True
    )


def test_stateless_apply_matches_apply(backend):
    cases.check_stateless(backend, AdamW, learning_rate=0.01, amsgrad=True)


def test_jit_stateless_apply_matches_eager():
    cases.check_jit(AdamW, learning_rate=0.01, weight_decay=0.05, clipvalue=0.5)


def test_config_round_trip():
    cases.check_config_round_trip(
        AdamW,
        learning_rate=0.02,
        weight_decay=0.1,
        beta_1=0.8,
        amsgrad=True,
        clipnorm=1.0,
        name="my_adamw",
    )


def test_resumes_from_config_and_saved_variables(backend):
    cases.check_resume(backend, AdamW, learning_rate=0.01, weight_decay=0.05, amsgrad=True)


def test_defaults_follow_keras():
    opt = AdamW()
    assert isinstance(opt, Adam)
    assert (opt.name, opt.weight_decay, opt.beta_1, opt.beta_2, opt.epsilon, opt.amsgrad) == (
        "adam_w",
        0.004,
        0.9,
        0.999,
        1e-7,
        False,
    )
    assert float(opt.learning_rate) == pytest.approx(0.001)
    assert AdamW(0.1, 0.2).weight_decay == 0.2  # weight_decay is the second argument


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"weight_decay": None},
            "`weight_decay` must be a finite number >= 0. Received: weight_decay=None",
        ),
        (
            {"weight_decay": -0.1},
            "`weight_decay` must be a finite number >= 0. Received: weight_decay=-0.1",
        ),
        ({"beta_1": 1.0}, "`beta_1` must be a finite number >= 0 and < 1. Received: beta_1=1.0"),
        ({"beta_2": -0.5}, "`beta_2` must be a finite number >= 0 and < 1. Received: beta_2=-0.5"),
        ({"epsilon": 0.0}, "`epsilon` must be a finite number > 0. Received: epsilon=0.0"),
        (
            {"learning_rate": -1.0},
            "`learning_rate` must be a finite number >= 0. Received: learning_rate=-1.0",
        ),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AdamW(**kwargs)


def test_docstring_example():
    cases.check_doctest(adamw_module)
