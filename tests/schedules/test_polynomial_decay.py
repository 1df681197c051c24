"""PolynomialDecay: to the end rate and held there, or cycling."""

import math
import re

import pytest

from lossscale.schedules import PolynomialDecay
from lossscale.schedules import polynomial_decay as polynomial_decay_module
from tests import schedule_cases as cases

STEPS = [0, 1, 4, 8, 9, 10, 17, 18, 19, 50]
SETTINGS = [
    {"initial_learning_rate": 0.1, "decay_steps": 9},
    {"initial_learning_rate": 0.1, "decay_steps": 9, "end_learning_rate": 0.01, "power": 2.0},
    {
        "initial_learning_rate": 0.1,
        "decay_steps": 9,
        "end_learning_rate": 0.01,
        "power": 0.5,
        "cycle": True,
    },
]
IDS = ["linear", "quadratic", "cycle"]


def reference(initial_learning_rate, decay_steps, end_learning_rate=0.0001, power=1.0, cycle=False):
    def value(step):
        if cycle:
            horizon = decay_steps * max(1, math.ceil(step / decay_steps))
        else:
            horizon, step = decay_steps, min(step, decay_steps)
        return (initial_learning_rate - end_learning_rate) * (
            1 - step / horizon
        ) ** power + end_learning_rate

    return value


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_values_match_float64_reference(backend, settings):
    cases.check_values(backend, PolynomialDecay(**settings), reference(**settings), STEPS)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_python_int_steps(settings):
    cases.check_python_steps(PolynomialDecay(**settings), reference(**settings), STEPS)


def test_cycle_restarts_after_each_period():
    schedule = PolynomialDecay(1.0, 10, end_learning_rate=0.0, cycle=True)
    # Step 10 ends the first period; step 11 starts a 20-step horizon.
    assert [round(float(schedule(s)), 6) for s in (0, 10, 11, 20, 21)] == [1.0, 0.0, 0.45, 0.0, 0.3]


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_traces_under_jit(settings):
    cases.check_jit(PolynomialDecay(**settings), STEPS)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_config_round_trip(settings):
    schedule = PolynomialDecay(**settings)
    defaults = {
        "end_learning_rate": 0.0001,
        "power": 1.0,
        "cycle": False,
        "name": "PolynomialDecay",
    }
    assert schedule.get_config() == {**defaults, **settings}
    cases.check_config(schedule, STEPS)


def test_optimizer_serializes_and_follows_schedule(backend):
    cases.check_in_optimizer(
        backend, PolynomialDecay(0.1, 4, 0.01, cycle=True), reference(0.1, 4, 0.01, cycle=True)
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"decay_steps": 0}, "`decay_steps` must be a finite number > 0. Received: decay_steps=0"),
        (
            {"end_learning_rate": -1.0},
            "`end_learning_rate` must be a finite number >= 0. Received: end_learning_rate=-1.0",
        ),
        ({"power": -1.0}, "`power` must be a finite number >= 0. Received: power=-1.0"),
        ({"cycle": None}, "`cycle` must be a boolean. Received: cycle=None"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    settings = {"initial_learning_rate": 0.1, "decay_steps": 10, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        PolynomialDecay(**settings)


def test_docstring_example():
    cases.check_doctest(polynomial_decay_module)
