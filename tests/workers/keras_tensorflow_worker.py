"""Keras 3's own trajectories on its TensorFlow backend (not a test module).

Keras reads `KERAS_BACKEND` once, at import, and the test process runs
Keras on torch; so `tests/test_keras_parity_tensorflow.py` runs this file
in a subprocess: `python keras_tensorflow_worker.py SPECS.json OUT.json`.
Each spec names an optimizer (and optionally the `LossScaleOptimizer`
around it), its settings, the initial weights and the gradients of every
step; the worker applies them with Keras, eagerly or inside a
`tf.function`, and writes every model and optimizer variable after every
step, by name.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def _optimizer(name, settings):
    settings = dict(settings)
    schedule = settings.get("learning_rate")
    if isinstance(schedule, list):  # [schedule class name, its settings]
        settings["learning_rate"] = getattr(keras.optimizers.schedules, schedule[0])(**schedule[1])
    return getattr(keras.optimizers, name)(**settings)


def _snapshot(optimizer, variables):
    out = {v.name: np.asarray(v.numpy(), np.float64).tolist() for v in variables}
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    for v in optimizer.variables:
        # Keras 3.15 auto-tracks Nadam's running product as "variable".
        key = "u_product" if v is getattr(inner, "_u_product", None) else v.name
        out[key] = np.asarray(v.numpy(), np.float64).tolist()
    return out


def trajectory(spec):
    optimizer = _optimizer(spec["optimizer"], spec["settings"])
    if spec.get("wrap") is not None:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, **spec["wrap"])
    variables = [
        keras.Variable(np.asarray(w, np.float32), name=f"w{i}")
        for i, w in enumerate(spec["weights"])
    ]

    def step(grads):
        optimizer.apply(grads, variables)

    if spec.get("tf_function"):
        step = tf.function(step)
    history = []
    for grads in spec["gradients"]:
        step([None if g is None else tf.constant(np.asarray(g, np.float32)) for g in grads])
        snapshot = _snapshot(optimizer, variables)
        if spec.get("wrap") is not None:
            snapshot["scale"] = float(optimizer.dynamic_scale.numpy())
            snapshot["counter"] = int(optimizer.step_counter.numpy())
            snapshot["iterations"] = int(optimizer.iterations.numpy())
        history.append(snapshot)
    return history


if __name__ == "__main__":
    assert keras.backend.backend() == "tensorflow"
    with open(sys.argv[1], encoding="utf-8") as f:
        specs = json.load(f)
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump({key: trajectory(spec) for key, spec in specs.items()}, f)
