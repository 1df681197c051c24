"""Every optimizer of the family against Keras 3 (torch backend), step by step.

Keras reads `KERAS_BACKEND` once, at import, so it is set before the import
(other modules of the suite that import Keras set the same value). Each
scenario runs Keras once (cached) and compares every model and optimizer
variable after every step, on each of our backends, at 1e-5 relative.
"""

import functools
import inspect
import os
import re

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import optimizer_cases as cases  # noqa: E402
import pytest  # noqa: E402

import lossscale as ls  # noqa: E402

NAMES = ["AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl", "Lamb"]

# Per optimizer: a default-settings scenario and one with its own options,
# weight decay and a clipping option (the three clipping options rotate).
SCENARIOS = {
    "AdamW": [
        {"learning_rate": 0.01},
        {"learning_rate": 0.01, "amsgrad": True, "weight_decay": 0.1, "clipnorm": 0.5},
    ],
    "RMSprop": [
        {"learning_rate": 0.01},
        {
            "learning_rate": 0.01,
            "momentum": 0.9,
            "centered": True,
            "rho": 0.8,
            "weight_decay": 0.05,
            "clipvalue": 0.5,
        },
    ],
    "Adagrad": [
        {"learning_rate": 0.1},
        {
            "learning_rate": 0.1,
            "initial_accumulator_value": 0.5,
            "weight_decay": 0.05,
            "global_clipnorm": 1.5,
        },
    ],
    "Adadelta": [
        {"learning_rate": 1.0, "epsilon": 1e-3},
        {"learning_rate": 1.0, "rho": 0.5, "epsilon": 1e-2, "weight_decay": 0.05, "clipnorm": 0.7},
    ],
    "Adamax": [
        {"learning_rate": 0.01},
        {
            "learning_rate": 0.01,
            "beta_1": 0.5,
            "beta_2": 0.9,
            "weight_decay": 0.05,
            "clipvalue": 0.5,
        },
    ],
    "Nadam": [
        {"learning_rate": 0.01},
        {"learning_rate": 0.01, "beta_1": 0.8, "weight_decay": 0.05, "global_clipnorm": 1.5},
    ],
    "Lion": [
        {"learning_rate": 0.01},
        {"learning_rate": 0.01, "beta_1": 0.5, "beta_2": 0.9, "weight_decay": 0.5, "clipnorm": 0.5},
    ],
    "Ftrl": [
        {"learning_rate": 0.1},
        {
            "learning_rate": 0.1,
            "learning_rate_power": -0.7,
            "initial_accumulator_value": 0.5,
            "l1_regularization_strength": 0.05,
            "l2_regularization_strength": 0.1,
            "l2_shrinkage_regularization_strength": 0.02,
            "beta": 0.3,
            "weight_decay": 0.05,
            "clipvalue": 0.5,
        },
    ],
    "Lamb": [
        {"learning_rate": 0.01},
        {"learning_rate": 0.01, "beta_1": 0.8, "weight_decay": 0.05, "global_clipnorm": 1.5},
    ],
}
# A schedule as learning rate: read from the raw iteration count, and no
# `learning_rate` variable on either side.
SCHEDULED = {
    "RMSprop": (
        "ExponentialDecay",
        {"initial_learning_rate": 0.02, "decay_steps": 2, "decay_rate": 0.5, "staircase": True},
    ),
    "Nadam": (
        "CosineDecay",
        {"initial_learning_rate": 0.0, "decay_steps": 4, "warmup_target": 0.02, "warmup_steps": 2},
    ),
    "Ftrl": ("PiecewiseConstantDecay", {"boundaries": [1, 3], "values": [0.3, 0.2, 0.1]}),
    "Lamb": ("CosineDecayRestarts", {"initial_learning_rate": 0.02, "first_decay_steps": 2}),
}
for _name, _schedule in SCHEDULED.items():
    SCENARIOS[_name].append({"learning_rate": _schedule, "weight_decay": 0.05})
PARAMS = [(name, i) for name in NAMES for i in range(len(SCENARIOS[name]))]
IDS = [f"{name}-{['defaults', 'options', 'schedule'][i]}" for name, i in PARAMS]


def build(library, name, index):
    """The optimizer of scenario `index` from `library` (keras or lossscale)."""
    settings = dict(SCENARIOS[name][index])
    if isinstance(settings["learning_rate"], tuple):
        schedule, schedule_settings = settings["learning_rate"]
        schedules = keras.optimizers.schedules if library is keras else ls.schedules
        settings["learning_rate"] = getattr(schedules, schedule)(**schedule_settings)
    return getattr(library.optimizers, name)(**settings)


def test_keras_runs_on_torch():
    assert keras.backend.backend() == "torch"


@functools.cache
def keras_trajectory(name, index):
    """Keras's snapshots `{variable name: value}` after each step."""
    optimizer = build(keras, name, index)
    variables = [keras.Variable(w, name=f"w{i}") for i, w in enumerate(cases.weights())]
    history = []
    for step_grads in cases.gradients():
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in step_grads], variables)
        snapshot = {v.name: np.asarray(v.numpy(), np.float64) for v in variables}
        for v in optimizer.variables:
            # Keras 3.15 auto-tracks Nadam's running product as "variable".
            key = "u_product" if v is getattr(optimizer, "_u_product", None) else v.name
            snapshot[key] = np.asarray(v.numpy(), np.float64)
        history.append(snapshot)
    return history


@pytest.mark.parametrize("name,index", PARAMS, ids=IDS)
def test_every_variable_matches_keras_after_every_step(backend, name, index):
    expected = keras_trajectory(name, index)
    optimizer = build(ls, name, index)
    variables = cases.model_variables(backend, cases.weights())
    for t, (step_grads, want) in enumerate(zip(cases.gradients(), expected)):
        optimizer.apply([backend.array(g) for g in step_grads], variables)
        cases.assert_same_snapshot(
            cases.snapshot(optimizer, variables),
            want,
            rtol=1e-5,
            atol=1e-7,
            context=f"{name} step {t + 1}",
        )


@pytest.mark.parametrize("name", NAMES)
def test_default_config_matches_keras(name):
    ours = getattr(ls.optimizers, name)().get_config()
    theirs = getattr(keras.optimizers, name)().get_config()
    # Keras numbers repeated default names ("lamb_2"); the first one is bare.
    theirs["name"] = re.sub(r"_\d+$", "", theirs["name"])
    assert ours == theirs


@pytest.mark.parametrize("name", NAMES)
def test_argument_order_matches_keras(name):
    """Positional use works as in Keras: our arguments are a prefix of Keras's."""

    def arguments(cls):
        return [
            p
            for p in inspect.signature(cls.__init__).parameters
            if p not in ("self", "name", "kwargs")
        ]

    ours = arguments(getattr(ls.optimizers, name))
    assert arguments(getattr(keras.optimizers, name))[: len(ours)] == ours
