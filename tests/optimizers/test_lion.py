"""Lion: sign of an interpolated momentum."""

import functools
import re

import numpy as np
import optimizer_cases as cases
import pytest

from lossscale.optimizers import Lion
from lossscale.optimizers import lion as lion_module


class LionRule(cases.Rule):
    """Chen et al. (2023), "Symbolic Discovery of Optimization Algorithms", Algorithm 2."""

    def __init__(self, beta_1=0.9, beta_2=0.99):
        self.beta_1, self.beta_2 = beta_1, beta_2

    def slots(self, w):
        return {"momentum": np.zeros_like(w)}

    def step(self, g, w, s, lr, t):
        update = np.sign(self.beta_1 * s["momentum"] + (1 - self.beta_1) * g)
        s["momentum"] = self.beta_2 * s["momentum"] + (1 - self.beta_2) * g
        return w - lr * update


VARIANTS = [{}, {"beta_1": 0.5, "beta_2": 0.9}]
CASES = [(None, {}), (0.5, {"clipnorm": 0.5})]


@pytest.mark.parametrize("options", VARIANTS, ids=["default", "custom_betas"])
@pytest.mark.parametrize("weight_decay,clip", CASES, ids=["no_decay", "decay_clipnorm"])
def test_matches_float64_reference(backend, options, weight_decay, clip):
    cases.check_reference(
        backend, functools.partial(Lion, **options), LionRule(**options), 0.01, weight_decay, **clip
    )


def test_inside_loss_scale_optimizer(backend):
    cases.check_loss_scale(backend, Lion, learning_rate=0.01, weight_decay=0.5, global_clipnorm=1.0)


def test_stateless_apply_matches_apply(backend):
    cases.check_stateless(backend, Lion, learning_rate=0.01)


def test_jit_stateless_apply_matches_eager():
    cases.check_jit(Lion, learning_rate=0.01, weight_decay=0.5)


def test_config_round_trip():
    cases.check_config_round_trip(
        Lion, learning_rate=0.0003, beta_1=0.95, beta_2=0.98, weight_decay=1.0
    )


def test_resumes_from_config_and_saved_variables(backend):
    cases.check_resume(backend, Lion, learning_rate=0.01, clipvalue=0.5)


def test_beta_1_of_one_is_accepted():
    assert Lion(beta_1=1.0).beta_1 == 1.0  # as in Keras: the range is (0, 1]


def test_defaults_follow_keras():
    opt = Lion()
    assert (opt.name, opt.beta_1, opt.beta_2) == ("lion", 0.9, 0.99)
    assert float(opt.learning_rate) == pytest.approx(0.001)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"beta_1": 0.0}, "`beta_1` must be a finite number > 0 and <= 1. Received: beta_1=0.0"),
        ({"beta_1": 1.1}, "`beta_1` must be a finite number > 0 and <= 1. Received: beta_1=1.1"),
        ({"beta_2": 1.0}, "`beta_2` must be a finite number >= 0 and < 1. Received: beta_2=1.0"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Lion(**kwargs)


def test_docstring_example():
    cases.check_doctest(lion_module)
