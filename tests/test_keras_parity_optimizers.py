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
import pytest  # noqa: E402

import lossscale as ls  # noqa: E402
from tests import keras_scenarios  # noqa: E402
from tests import optimizer_cases as cases  # noqa: E402

SCENARIOS, KINDS = keras_scenarios.SCENARIOS, keras_scenarios.KINDS

# SGD and Adam are compared with Keras in their own modules.
NAMES = ["AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl", "Lamb"]

PARAMS = [(name, i) for name in NAMES for i in range(len(SCENARIOS[name]))]
IDS = [f"{name}-{KINDS[i]}" for name, i in PARAMS]


def build(library, name, index):
    """The optimizer of scenario `index` from `library` (keras or lossscale)."""
    return keras_scenarios.build(library, name, SCENARIOS[name][index])


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
