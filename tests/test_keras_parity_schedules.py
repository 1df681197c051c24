"""Every learning-rate schedule against Keras 3 (torch backend).

Keras reads `KERAS_BACKEND` once, at import, so it is set before the import
(other modules of the suite that import Keras set the same value).
"""

import functools
import inspect
import os

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import lossscale as ls  # noqa: E402
from tests import schedule_cases as cases  # noqa: E402

STEPS = range(0, 160)
SETTINGS = [
    ("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 7, "decay_rate": 0.5}),
    (
        "ExponentialDecay",
        {"initial_learning_rate": 0.1, "decay_steps": 7, "decay_rate": 0.5, "staircase": True},
    ),
    ("InverseTimeDecay", {"initial_learning_rate": 0.1, "decay_steps": 3, "decay_rate": 0.7}),
    (
        "InverseTimeDecay",
        {"initial_learning_rate": 0.1, "decay_steps": 3, "decay_rate": 0.7, "staircase": True},
    ),
    (
        "PolynomialDecay",
        {"initial_learning_rate": 0.1, "decay_steps": 9, "end_learning_rate": 0.01, "power": 2.0},
    ),
    (
        "PolynomialDecay",
        {
            "initial_learning_rate": 0.1,
            "decay_steps": 9,
            "end_learning_rate": 0.01,
            "power": 0.5,
            "cycle": True,
        },
    ),
    ("PiecewiseConstantDecay", {"boundaries": [5, 10, 20], "values": [0.1, 0.05, 0.01, 0.001]}),
    ("CosineDecay", {"initial_learning_rate": 0.1, "decay_steps": 20, "alpha": 0.1}),
    (
        "CosineDecay",
        {
            "initial_learning_rate": 0.01,
            "decay_steps": 20,
            "alpha": 0.1,
            "warmup_target": 0.1,
            "warmup_steps": 8,
        },
    ),
    (
        "CosineDecayRestarts",
        {"initial_learning_rate": 0.1, "first_decay_steps": 5, "m_mul": 0.7, "alpha": 0.05},
    ),
    (
        "CosineDecayRestarts",
        {"initial_learning_rate": 0.1, "first_decay_steps": 5, "t_mul": 1.0, "m_mul": 0.7},
    ),
    (
        "CosineDecayRestarts",
        {"initial_learning_rate": 0.1, "first_decay_steps": 3, "t_mul": 1.5, "m_mul": 0.9},
    ),
]
NAMES = sorted({name for name, _ in SETTINGS})
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(SETTINGS)]


def test_keras_runs_on_torch():
    assert keras.backend.backend() == "torch"


@functools.cache
def keras_values(index):
    name, settings = SETTINGS[index]
    schedule = getattr(keras.optimizers.schedules, name)(**settings)
    return [float(schedule(torch.tensor(step))) for step in STEPS]


@pytest.mark.parametrize("index", range(len(SETTINGS)), ids=IDS)
def test_values_match_keras(backend, index):
    name, settings = SETTINGS[index]
    ours = getattr(ls.schedules, name)(**settings)
    expected = keras_values(index)
    got = [float(backend.numpy(ours(cases.step_array(backend, step)))) for step in STEPS]
    # atol: float32 cancellation near a zero learning rate (see schedule_cases).
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=cases.ATOL)


@pytest.mark.parametrize("index", range(len(SETTINGS)), ids=IDS)
def test_config_matches_keras(index):
    name, settings = SETTINGS[index]
    ours = getattr(ls.schedules, name)(**settings).get_config()
    assert ours == getattr(keras.optimizers.schedules, name)(**settings).get_config()


@pytest.mark.parametrize("name", NAMES)
def test_signature_matches_keras(name):
    def parameters(cls):
        return [(p.name, p.default) for p in inspect.signature(cls.__init__).parameters.values()]

    assert parameters(getattr(ls.schedules, name)) == parameters(
        getattr(keras.optimizers.schedules, name)
    )


@pytest.mark.parametrize("index", [0, 8, 9], ids=[IDS[0], IDS[8], IDS[9]])
def test_keras_config_builds_our_schedule(index):
    name, settings = SETTINGS[index]
    config = getattr(keras.optimizers.schedules, name)(**settings).get_config()
    ours = getattr(ls.schedules, name).from_config(config)
    assert ours.get_config() == config
