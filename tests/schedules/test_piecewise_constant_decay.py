"""PiecewiseConstantDecay: values between boundaries, boundaries inclusive on the left piece."""

import bisect
import json
import re

import numpy as np
import pytest

from lossscale.schedules import PiecewiseConstantDecay
from lossscale.schedules import piecewise_constant_decay as piecewise_constant_decay_module
from tests import schedule_cases as cases

STEPS = [0, 4, 5, 6, 10, 11, 20, 21, 1000]
SETTINGS = [
    {"boundaries": [5, 10, 20], "values": [0.1, 0.05, 0.01, 0.001]},
    {"boundaries": [5], "values": [1.0, 0.5]},
    {"boundaries": [4.5, 10.5], "values": [0.3, 0.2, 0.1]},
]
IDS = ["three_boundaries", "one_boundary", "float_boundaries"]


def reference(boundaries, values):
    # values[i] for boundaries[i-1] < step <= boundaries[i].
    return lambda step: values[bisect.bisect_left(boundaries, step)]


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_values_match_float64_reference(backend, settings):
    cases.check_values(backend, PiecewiseConstantDecay(**settings), reference(**settings), STEPS)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_python_int_steps(settings):
    cases.check_python_steps(PiecewiseConstantDecay(**settings), reference(**settings), STEPS)


def test_traces_under_jit():
    cases.check_jit(PiecewiseConstantDecay(**SETTINGS[0]), STEPS)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_config_round_trip(settings):
    schedule = PiecewiseConstantDecay(**settings)
    assert schedule.get_config() == {**settings, "name": "PiecewiseConstant"}
    cases.check_config(schedule, STEPS)


def test_tuples_are_stored_as_lists():
    schedule = PiecewiseConstantDecay((1, 2), (0.3, 0.2, 0.1))
    assert schedule.get_config()["boundaries"] == [1, 2]
    assert schedule.get_config()["values"] == [0.3, 0.2, 0.1]


def test_optimizer_serializes_and_follows_schedule(backend):
    cases.check_in_optimizer(
        backend, PiecewiseConstantDecay([1, 3], [0.3, 0.2, 0.1]), reference([1, 3], [0.3, 0.2, 0.1])
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"boundaries": [5, 10], "values": [0.1, 0.01]},
            "The length of `boundaries` should be 1 less than the length of `values`. Received: "
            "boundaries=[5, 10] of length 2, and values=[0.1, 0.01] of length 2.",
        ),
        (
            {"boundaries": [], "values": [0.1]},
            "`boundaries` must be a non-empty list of strictly increasing numbers. Received: "
            "boundaries=[]",
        ),
        (
            {"boundaries": [10, 5], "values": [0.1, 0.01, 0.001]},
            "`boundaries` must be a non-empty list of strictly increasing numbers. Received: "
            "boundaries=[10, 5]",
        ),
        (
            {"boundaries": 5, "values": [0.1, 0.01]},
            "`boundaries` must be a list of numbers. Received: boundaries=5",
        ),
        (
            {"boundaries": [5], "values": [0.1, "a"]},
            "`values` must be a list of numbers. Received: values=[0.1, 'a']",
        ),
        (
            {"boundaries": [5], "values": [0.1, 0.01], "name": None},
            "`name` must be a string. Received: name=None",
        ),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PiecewiseConstantDecay(**kwargs)


def test_numpy_scalars_become_python_numbers():
    schedule = PiecewiseConstantDecay([np.int64(3)], [np.float32(0.5), 0.25])
    config = schedule.get_config()
    assert type(config["boundaries"][0]) is int and type(config["values"][0]) is float
    json.dumps(config)


def test_docstring_example():
    cases.check_doctest(piecewise_constant_decay_module)
