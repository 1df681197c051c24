"""CosineDecay (with and without warmup) and CosineDecayRestarts."""

import math
import re

import pytest

from lossscale.schedules import CosineDecay, CosineDecayRestarts
from lossscale.schedules import cosine_decay as cosine_decay_module
from tests import schedule_cases as cases

STEPS = [0, 1, 3, 5, 7, 8, 9, 15, 20, 27, 28, 29, 100]
DECAY_SETTINGS = [
    {"initial_learning_rate": 0.1, "decay_steps": 20},
    {"initial_learning_rate": 0.1, "decay_steps": 20, "alpha": 0.1},
    {
        "initial_learning_rate": 0.01,
        "decay_steps": 20,
        "alpha": 0.1,
        "warmup_target": 0.1,
        "warmup_steps": 8,
    },
    {"initial_learning_rate": 0.1, "decay_steps": 20, "warmup_target": 0.2},
]
DECAY_IDS = ["plain", "alpha", "warmup", "warmup_target_without_steps"]
RESTART_SETTINGS = [
    {"initial_learning_rate": 0.1, "first_decay_steps": 5},
    {"initial_learning_rate": 0.1, "first_decay_steps": 5, "t_mul": 1.0, "m_mul": 0.7},
    {
        "initial_learning_rate": 0.1,
        "first_decay_steps": 3,
        "t_mul": 1.5,
        "m_mul": 0.9,
        "alpha": 0.05,
    },
]
RESTART_IDS = ["doubling", "constant_period", "growing_period"]


def cosine(fraction, alpha):
    return (1 - alpha) * 0.5 * (1 + math.cos(math.pi * fraction)) + alpha


def decay_reference(
    initial_learning_rate, decay_steps, alpha=0.0, warmup_target=None, warmup_steps=0
):
    def value(step):
        if warmup_target is None:
            return initial_learning_rate * cosine(min(step, decay_steps) / decay_steps, alpha)
        if step < warmup_steps:
            return (
                initial_learning_rate
                + (warmup_target - initial_learning_rate) * step / warmup_steps
            )
        step = min(step - warmup_steps, decay_steps)
        return warmup_target * cosine(step / decay_steps, alpha)

    return value


def restarts_reference(initial_learning_rate, first_decay_steps, t_mul=2.0, m_mul=1.0, alpha=0.0):
    def value(step):
        # Walk the periods: each is t_mul times longer and m_mul times lower.
        start, length, peak = 0.0, float(first_decay_steps), 1.0
        while step >= start + length:
            start, length, peak = start + length, length * t_mul, peak * m_mul
        fraction = (step - start) / length
        return initial_learning_rate * (
            (1 - alpha) * peak * 0.5 * (1 + math.cos(math.pi * fraction)) + alpha
        )

    return value


@pytest.mark.parametrize("settings", DECAY_SETTINGS, ids=DECAY_IDS)
def test_cosine_decay_matches_float64_reference(backend, settings):
    cases.check_values(backend, CosineDecay(**settings), decay_reference(**settings), STEPS)


@pytest.mark.parametrize("settings", RESTART_SETTINGS, ids=RESTART_IDS)
def test_restarts_match_float64_reference(backend, settings):
    cases.check_values(
        backend, CosineDecayRestarts(**settings), restarts_reference(**settings), STEPS
    )


@pytest.mark.parametrize("settings", DECAY_SETTINGS, ids=DECAY_IDS)
def test_cosine_decay_python_int_steps(settings):
    cases.check_python_steps(CosineDecay(**settings), decay_reference(**settings), STEPS)


@pytest.mark.parametrize("settings", RESTART_SETTINGS, ids=RESTART_IDS)
def test_restarts_python_int_steps(settings):
    cases.check_python_steps(CosineDecayRestarts(**settings), restarts_reference(**settings), STEPS)


def test_warmup_rises_linearly_then_decays():
    schedule = CosineDecay(0.0, 10, warmup_target=1.0, warmup_steps=4)
    assert [round(float(schedule(s)), 6) for s in (0, 1, 2, 4, 9, 14, 50)] == [
        0.0,
        0.25,
        0.5,
        1.0,
        0.5,
        0.0,
        0.0,
    ]


@pytest.mark.parametrize(
    "schedule",
    [
        CosineDecay(**DECAY_SETTINGS[2]),
        CosineDecayRestarts(**RESTART_SETTINGS[0]),
        CosineDecayRestarts(**RESTART_SETTINGS[1]),
    ],
    ids=["warmup", "restarts", "constant_period"],
)
def test_traces_under_jit(schedule):
    cases.check_jit(schedule, STEPS)


@pytest.mark.parametrize("settings", DECAY_SETTINGS, ids=DECAY_IDS)
def test_cosine_decay_config_round_trip(settings):
    schedule = CosineDecay(**settings)
    defaults = {"alpha": 0.0, "name": "CosineDecay", "warmup_target": None, "warmup_steps": 0}
    assert schedule.get_config() == {**defaults, **settings}
    cases.check_config(schedule, STEPS)


@pytest.mark.parametrize("settings", RESTART_SETTINGS, ids=RESTART_IDS)
def test_restarts_config_round_trip(settings):
    schedule = CosineDecayRestarts(**settings)
    defaults = {"t_mul": 2.0, "m_mul": 1.0, "alpha": 0.0, "name": "SGDRDecay"}
    assert schedule.get_config() == {**defaults, **settings}
    cases.check_config(schedule, STEPS)


def test_optimizer_serializes_and_follows_cosine_decay(backend):
    settings = {
        "initial_learning_rate": 0.0,
        "decay_steps": 4,
        "warmup_target": 0.2,
        "warmup_steps": 2,
    }
    cases.check_in_optimizer(backend, CosineDecay(**settings), decay_reference(**settings))


def test_optimizer_serializes_and_follows_restarts(backend):
    settings = {"initial_learning_rate": 0.2, "first_decay_steps": 2, "m_mul": 0.5}
    cases.check_in_optimizer(
        backend, CosineDecayRestarts(**settings), restarts_reference(**settings)
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"decay_steps": 0}, "`decay_steps` must be a finite number > 0. Received: decay_steps=0"),
        ({"alpha": 1.5}, "`alpha` must be a finite number >= 0 and <= 1. Received: alpha=1.5"),
        (
            {"warmup_target": -0.1},
            "`warmup_target` must be a finite number >= 0 or None. Received: warmup_target=-0.1",
        ),
        (
            {"warmup_steps": -1},
            "`warmup_steps` must be a finite number >= 0. Received: warmup_steps=-1",
        ),
        ({"name": b"x"}, "`name` must be a string. Received: name=b'x'"),
    ],
)
def test_cosine_decay_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CosineDecay(**{"initial_learning_rate": 0.1, "decay_steps": 10, **kwargs})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"first_decay_steps": -2},
            "`first_decay_steps` must be a finite number > 0. Received: first_decay_steps=-2",
        ),
        ({"t_mul": 0.0}, "`t_mul` must be a finite number > 0. Received: t_mul=0.0"),
        ({"m_mul": -0.5}, "`m_mul` must be a finite number >= 0. Received: m_mul=-0.5"),
        ({"alpha": -0.1}, "`alpha` must be a finite number >= 0 and <= 1. Received: alpha=-0.1"),
    ],
)
def test_restarts_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CosineDecayRestarts(**{"initial_learning_rate": 0.1, "first_decay_steps": 10, **kwargs})


def test_docstring_example():
    cases.check_doctest(cosine_decay_module)
