"""Steps `lossscale bench` rows and reads their parameters back, for tests/bench/test_impl_*.py.

Run as `python -m tests.workers.bench_row_worker WORKLOAD STEPS NAME...` in
a process started with the rows' environment (`KERAS_BACKEND`): steps each
row `STEPS` times on the `quick` version of `WORKLOAD` and prints
`RESULT_PREFIX` and `{name: [parameter as a nested list, ...]}` as JSON on
the last line of stdout. In process, `final_params` does the same for one
row; `keras_adam`, `torch_adam` and the other rules are the float64 NumPy
references the tests compare the rows with.

A row's parameters are read where its setup put them, without reaching
into the row: the NumPy arrays `workloads.arrays` returned (torch tensors on
the CPU share their memory), the `tf.Variable`s of
`frameworks.tensorflow_arrays`, the `keras.Variable`s the row created, or
what a JAX row's step returns.
"""

import contextlib
import json
import math
import os
import subprocess
import sys
from unittest import mock

import numpy as np

from lossscale.bench import frameworks, registry, workloads
from tests.workers import ROOT, command

RESULT_PREFIX = "BENCH_ROW_RESULT "
LEARNING_RATE = 1e-3
EPSILON = 1e-7  # every Adam row's, Keras's default


@contextlib.contextmanager
def _recording(keras):
    seen = {"numpy": [], "tensorflow": [], "keras": []}
    arrays, tensorflow_arrays = workloads.arrays, frameworks.tensorflow_arrays

    def record_arrays(*args, **kwargs):
        out = arrays(*args, **kwargs)
        seen["numpy"].append(out[0])
        return out

    def record_tensorflow_arrays(*args, **kwargs):
        out = tensorflow_arrays(*args, **kwargs)
        seen["tensorflow"].append(out[0])
        return out

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(workloads, "arrays", record_arrays))
        stack.enter_context(
            mock.patch.object(frameworks, "tensorflow_arrays", record_tensorflow_arrays)
        )
        if keras is not None:
            variable = keras.Variable

            def record_variable(*args, **kwargs):
                out = variable(*args, **kwargs)
                seen["keras"].append(out)
                return out

            stack.enter_context(mock.patch.object(keras, "Variable", record_variable))
        yield seen


def final_params(name, workload, steps):
    """Float64 copies of row `name`'s parameters after `steps` steps on `workload`."""
    impl = registry.load()[name]
    keras = None
    if "KERAS_BACKEND" in impl.env:
        import keras
    with _recording(keras) as seen:
        stepper = impl.setup(workload)
        result = None
        for _ in range(steps):
            if stepper.prepare is not None:
                stepper.prepare()
            result = stepper.step()
            stepper.sync(result)
    if isinstance(result, list):  # a JAX row's new parameters (its variables are donated)
        return [np.asarray(p, np.float64) for p in result]
    if seen["keras"]:
        return [np.asarray(keras.ops.convert_to_numpy(v.value), np.float64) for v in seen["keras"]]
    if seen["tensorflow"]:
        return [np.asarray(v.numpy(), np.float64) for v in seen["tensorflow"][0]]
    return [p.astype(np.float64) for p in seen["numpy"][0]]


def _initial(workload):
    params, grads = workloads.arrays(workload, loss_scaled=False)
    return [p.astype(np.float64) for p in params], [g.astype(np.float64) for g in grads]


def keras_adam(workload, steps, weight_decay=0.0):
    """Keras's (and lossscale's) Adam(W) from the unscaled gradients, in float64."""
    params, grads = _initial(workload)
    out = []
    for p, g in zip(params, grads):
        m, v = np.zeros_like(p), np.zeros_like(p)
        for t in range(1, steps + 1):
            p = p - p * (weight_decay * LEARNING_RATE)
            m = m + (g - m) * (1 - 0.9)
            v = v + (g * g - v) * (1 - 0.999)
            alpha = LEARNING_RATE * math.sqrt(1 - 0.999**t) / (1 - 0.9**t)
            p = p - m * alpha / (np.sqrt(v) + EPSILON)
        out.append(p)
    return out


def torch_adam(workload, steps, weight_decay=0.0):
    """`torch.optim.Adam(W)`'s rule from the unscaled gradients, in float64.

    torch adds epsilon after the bias correction of the second moment, Keras
    before: they differ by about 3e-6 in the first step's update.
    """
    params, grads = _initial(workload)
    out = []
    for p, g in zip(params, grads):
        m, v = np.zeros_like(p), np.zeros_like(p)
        for t in range(1, steps + 1):
            p = p * (1 - LEARNING_RATE * weight_decay)
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            denom = np.sqrt(v) / math.sqrt(1 - 0.999**t) + EPSILON
            p = p - LEARNING_RATE / (1 - 0.9**t) * m / denom
        out.append(p)
    return out


def sgd_momentum(workload, steps, momentum=0.9):
    """SGD with momentum (torch's and Keras's rule agree) from the unscaled gradients."""
    params, grads = _initial(workload)
    out = []
    for p, g in zip(params, grads):
        velocity = np.zeros_like(p)
        for _ in range(steps):
            velocity = momentum * velocity - LEARNING_RATE * g
            p = p + velocity
        out.append(p)
    return out


def launch(keras_backend, workload, steps, names):
    """Runs this script with `KERAS_BACKEND=keras_backend`; `{name: float64 parameters}`."""
    proc = subprocess.run(
        command(__file__, workload, steps, *names),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "KERAS_BACKEND": keras_backend},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.splitlines()[-1]
    assert last.startswith(RESULT_PREFIX), proc.stdout[-3000:]
    result = json.loads(last[len(RESULT_PREFIX) :])
    return {n: [np.asarray(p, np.float64) for p in params] for n, params in result.items()}


def main(argv):
    workload, steps, *names = argv
    workload = workloads.get(workload, quick=True)
    result = {n: [p.tolist() for p in final_params(n, workload, int(steps))] for n in names}
    sys.stdout.write("\n" + RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
