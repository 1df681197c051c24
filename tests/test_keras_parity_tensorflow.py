"""Parity with Keras 3 on its TensorFlow backend: every optimizer and the wrapper.

Keras runs in a subprocess with `KERAS_BACKEND=tensorflow`
(`workers/keras_tensorflow_worker.py`; this process runs Keras on torch), once for
every scenario below; our optimizers run the same scenarios here, on
`tf.Variable`s, and every model and optimizer variable is compared after
every step at 1e-5 relative, as the torch-backend parity tests do. The
wrapper's scenarios inject inf and NaN steps and compare the scale, the
counter and `iterations` exactly; two of them run inside `tf.function` on
both sides.
"""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest
import tensorflow as tf

import lossscale as ls
from tests import keras_scenarios, workers
from tests import optimizer_cases as cases

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore::lossscale.mixed_precision.UnscaledLossWarning", "ignore::UserWarning"
    ),
    # One test process runs this module: Keras's TensorFlow subprocess (the
    # `keras_results` fixture) runs once, not once in each.
    pytest.mark.xdist_group("keras_parity_tensorflow"),
]

WORKER = pathlib.Path(__file__).parent / "workers" / "keras_tensorflow_worker.py"

FAMILY = keras_scenarios.SCENARIOS
# The wrapper: around every optimizer's defaults, and Keras's own
# interplay cases (accumulation and EMA inside the wrapper, clipping).
WRAPPED = {f"{name}-defaults": (name, settings[0]) for name, settings in FAMILY.items()}
WRAPPED.update(
    {
        "Adam-options": ("Adam", FAMILY["Adam"][1]),
        "SGD-options": ("SGD", FAMILY["SGD"][1]),
        "SGD-accumulation-ema": (
            "SGD",
            {
                "learning_rate": 0.05,
                "gradient_accumulation_steps": 2,
                "use_ema": True,
                "ema_momentum": 0.9,
                "ema_overwrite_frequency": 2,
            },
        ),
    }
)
IN_TF_FUNCTION = ["Adam-defaults", "SGD-accumulation-ema"]
PATTERN = ["f", "f", "inf", "f", "nan", "f", "f", "f", "inf", "f", "f", "f"]
SCALE = 256.0
WRAP = {"initial_scale": SCALE, "dynamic_growth_steps": 3}


def _wrapped_gradients():
    rng = np.random.default_rng(42)
    steps = []
    for kind in PATTERN:
        grads = [rng.normal(size=s).astype(np.float32) * np.float32(SCALE) for s in cases.SHAPES]
        if kind != "f":
            grads[1][2] = np.inf if kind == "inf" else np.nan
        steps.append(grads)
    return steps


def _specs():
    weights = [w.tolist() for w in cases.weights()]
    family_grads = [[g.tolist() for g in step] for step in cases.gradients()]
    wrapped_grads = [[g.tolist() for g in step] for step in _wrapped_gradients()]
    specs = {}
    for name, scenarios in FAMILY.items():
        for i, settings in enumerate(scenarios):
            specs[f"family/{name}-{i}"] = {
                "optimizer": name,
                "settings": settings,
                "weights": weights,
                "gradients": family_grads,
            }
    for key, (name, settings) in WRAPPED.items():
        for in_function in (False, True) if key in IN_TF_FUNCTION else (False,):
            specs[f"wrapped/{key}" + ("/tf.function" if in_function else "")] = {
                "optimizer": name,
                "settings": settings,
                "wrap": WRAP,
                "weights": weights,
                "gradients": wrapped_grads,
                "tf_function": in_function,
            }
    return specs


SPECS = _specs()


@pytest.fixture(scope="module")
def keras_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keras_tensorflow")
    (folder / "specs.json").write_text(json.dumps(SPECS))
    proc = subprocess.run(
        workers.command(WORKER, folder / "specs.json", folder / "out.json"),
        cwd=workers.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "KERAS_BACKEND": "tensorflow"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((folder / "out.json").read_text())


def _run_ours(spec):
    optimizer = keras_scenarios.build(ls, spec["optimizer"], spec["settings"])
    if spec.get("wrap"):
        optimizer = ls.LossScaleOptimizer(optimizer, **spec["wrap"])
    variables = [
        ls.Variable(tf.Variable(np.asarray(w, np.float32)), name=f"w{i}")
        for i, w in enumerate(spec["weights"])
    ]
    optimizer.build(variables)

    def step(grads):
        optimizer.apply(grads, variables)

    if spec.get("tf_function"):
        step = tf.function(step)
    history = []
    for grads in spec["gradients"]:
        step([tf.constant(np.asarray(g, np.float32)) for g in grads])
        state = None
        if spec.get("wrap"):
            state = (
                float(optimizer.dynamic_scale),
                int(optimizer.step_counter),
                int(optimizer.iterations),
            )
        history.append((cases.snapshot(optimizer, variables), state))
    return history, optimizer


def test_keras_runs_on_tensorflow_in_the_worker():
    text = WORKER.read_text()
    assert 'os.environ["KERAS_BACKEND"] = "tensorflow"' in text
    assert 'assert keras.backend.backend() == "tensorflow"' in text


@pytest.mark.parametrize("key", [k for k in SPECS if k.startswith("family/")])
def test_every_optimizer_matches_keras_on_tensorflow(keras_results, key):
    history, _ = _run_ours(SPECS[key])
    for t, ((ours, _), theirs) in enumerate(zip(history, keras_results[key])):
        cases.assert_same_snapshot(
            ours,
            {k: np.asarray(v, np.float64) for k, v in theirs.items()},
            rtol=1e-5,
            atol=1e-7,
            context=f"{key} step {t + 1}",
        )


@pytest.mark.parametrize("key", [k for k in SPECS if k.startswith("wrapped/")])
def test_the_wrapper_matches_keras_on_tensorflow(keras_results, key):
    history, optimizer = _run_ours(SPECS[key])
    # Keras's wrapper and inner optimizer each hold an `iteration` and a
    # `learning_rate`; compare the model, the inner slots and the loss-scale
    # state, which both name alike.
    # Keras's wrapper does not list Nadam's running product (Keras keeps it
    # outside its variables, see SPEC); ours is compared through the weights.
    slots = [
        v.name
        for v in optimizer.inner_optimizer.variables
        if v.name not in ("iteration", "learning_rate", "u_product")
    ]
    names = [f"w{i}" for i in range(len(cases.SHAPES))] + slots
    for t, ((ours, state), theirs) in enumerate(zip(history, keras_results[key])):
        assert state == (theirs["scale"], theirs["counter"], theirs["iterations"]), (key, t + 1)
        for name in names:
            np.testing.assert_allclose(
                ours[name], theirs[name], rtol=1e-5, atol=1e-6, err_msg=f"{key} step {t + 1} {name}"
            )
