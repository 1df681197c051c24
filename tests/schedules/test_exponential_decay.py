"""ExponentialDecay: continuous and staircase."""

import math
import re

import pytest

from lossscale.schedules import ExponentialDecay
from lossscale.schedules import exponential_decay as exponential_decay_module
from tests import schedule_cases as cases

STEPS = [0, 1, 6, 7, 8, 20, 100]
SETTINGS = [
    {"initial_learning_rate": 0.1, "decay_steps": 7, "decay_rate": 0.5},
    {"initial_learning_rate": 0.1, "decay_steps": 7, "decay_rate": 0.5, "staircase": True},
    {"initial_learning_rate": 2.0, "decay_steps": 2.5, "decay_rate": 1.1},
]
IDS = ["continuous", "staircase", "growing"]


def reference(initial_learning_rate, decay_steps, decay_rate, staircase=False):
    def value(step):
        periods = step / decay_steps
        return initial_learning_rate * decay_rate ** (math.floor(periods) if staircase else periods)

    return value


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_values_match_float64_reference(backend, settings):
    cases.check_values(backend, ExponentialDecay(**settings), reference(**settings), STEPS)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_python_int_steps(settings):
    cases.check_python_steps(ExponentialDecay(**settings), reference(**settings), STEPS)


def test_traces_under_jit():
    cases.check_jit(ExponentialDecay(0.1, 7, 0.5, staircase=True), STEPS)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_config_round_trip(settings):
    schedule = ExponentialDecay(**settings, name="decay")
    assert schedule.get_config() == {"staircase": False, **settings, "name": "decay"}
    cases.check_config(schedule, STEPS)


def test_optimizer_serializes_and_follows_schedule(backend):
    cases.check_in_optimizer(
        backend,
        ExponentialDecay(0.1, 2, 0.5, staircase=True),
        reference(0.1, 2, 0.5, staircase=True),
    )


def test_defaults():
    schedule = ExponentialDecay(0.1, 10, 0.9)
    assert (schedule.staircase, schedule.name) == (False, "ExponentialDecay")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"decay_steps": 0}, "`decay_steps` must be a finite number > 0. Received: decay_steps=0"),
        (
            {"decay_steps": -5},
            "`decay_steps` must be a finite number > 0. Received: decay_steps=-5",
        ),
        (
            {"initial_learning_rate": -0.1},
            "`initial_learning_rate` must be a finite number >= 0. Received: initial_learning_rate=-0.1",
        ),
        (
            {"decay_rate": -0.5},
            "`decay_rate` must be a finite number >= 0. Received: decay_rate=-0.5",
        ),
        ({"staircase": "yes"}, "`staircase` must be a boolean. Received: staircase='yes'"),
        ({"name": 3}, "`name` must be a string. Received: name=3"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    settings = {"initial_learning_rate": 0.1, "decay_steps": 10, "decay_rate": 0.9, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        ExponentialDecay(**settings)


def test_docstring_example():
    cases.check_doctest(exponential_decay_module)
