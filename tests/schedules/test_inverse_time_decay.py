"""InverseTimeDecay: continuous and staircase."""

import math
import re

import pytest

from lossscale.schedules import InverseTimeDecay
from lossscale.schedules import inverse_time_decay as inverse_time_decay_module
from tests import schedule_cases as cases

STEPS = [0, 1, 2, 3, 4, 10, 1000]
SETTINGS = [
    {"initial_learning_rate": 0.1, "decay_steps": 3, "decay_rate": 0.7},
    {"initial_learning_rate": 0.1, "decay_steps": 3, "decay_rate": 0.7, "staircase": True},
]
IDS = ["continuous", "staircase"]


def reference(initial_learning_rate, decay_steps, decay_rate, staircase=False):
    def value(step):
        periods = step / decay_steps
        return initial_learning_rate / (
            1 + decay_rate * (math.floor(periods) if staircase else periods)
        )

    return value


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_values_match_float64_reference(backend, settings):
    cases.check_values(backend, InverseTimeDecay(**settings), reference(**settings), STEPS)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_python_int_steps(settings):
    cases.check_python_steps(InverseTimeDecay(**settings), reference(**settings), STEPS)


def test_traces_under_jit():
    cases.check_jit(InverseTimeDecay(0.1, 3, 0.7, staircase=True), STEPS)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_config_round_trip(settings):
    schedule = InverseTimeDecay(**settings)
    assert schedule.get_config() == {"staircase": False, **settings, "name": "InverseTimeDecay"}
    cases.check_config(schedule, STEPS)


def test_optimizer_serializes_and_follows_schedule(backend):
    cases.check_in_optimizer(backend, InverseTimeDecay(0.1, 1, 0.5), reference(0.1, 1, 0.5))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"decay_steps": 0.0},
            "`decay_steps` must be a finite number > 0. Received: decay_steps=0.0",
        ),
        (
            {"decay_rate": float("nan")},
            "`decay_rate` must be a finite number >= 0. Received: decay_rate=nan",
        ),
        (
            {"initial_learning_rate": None},
            "`initial_learning_rate` must be a finite number >= 0. Received: initial_learning_rate=None",
        ),
        ({"staircase": 0}, "`staircase` must be a boolean. Received: staircase=0"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    settings = {"initial_learning_rate": 0.1, "decay_steps": 10, "decay_rate": 0.9, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        InverseTimeDecay(**settings)


def test_docstring_example():
    cases.check_doctest(inverse_time_decay_module)
