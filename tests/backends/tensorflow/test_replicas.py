"""Agreement across tf.distribute replicas: every replica takes the same skip.

The strategy scenarios run in a subprocess (`workers/tensorflow_mirrored_worker.py`)
with two logical CPUs. In each, the gradients are all-reduced and then one
replica's overflows (as a reduction that overflows on one device would):
both replicas must skip, stay identical, and equal a single-device run in
which that step overflows.
"""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from lossscale.backends.tensorflow import replicas
from tests import workers

TESTS = pathlib.Path(__file__).resolve().parents[2]
WORKER = TESTS / "workers" / "tensorflow_mirrored_worker.py"
# One test process runs the strategy scenarios (one subprocess).
pytestmark = pytest.mark.xdist_group("tensorflow_mirrored")
PATTERN = [None, 1, None, 0, None, None, 1, None]
TRAINED = ["adam", "sgd", "adam-headroom", "eager"]


def _run_worker(*scenarios):
    src = str(TESTS.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        workers.command(WORKER, *scenarios),
        cwd=workers.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


# Session-scoped: set up once per test process, however the tests of other
# modules interleave with these in it (a module fixture is set up again then).
# `no_merge_call` comes last: it switches the process's strategy into
# replica-context collectives and makes every later merge_call raise.
@pytest.fixture(scope="session")
def results():
    return _run_worker(*TRAINED, "xla_one_device", "xla_two_devices", "lazy_build", "no_merge_call")


@pytest.mark.parametrize("scenario", TRAINED)
def test_replicas_take_the_same_skip_when_one_overflows(results, scenario):
    result = results[scenario]
    assert result["kinds"] == ["MirroredVariable"]  # slots follow the mirrored model
    assert result["traces"] in (1, None)
    for t, (step, want) in enumerate(zip(result["history"], result["reference"])):
        # Mirrored copies stay identical: each replica wrote the same values.
        for name in ("variables", "slots"):
            for i, (first, second) in enumerate(step[name]):
                np.testing.assert_array_equal(first, second, err_msg=f"{name}[{i}] at step {t}")
        for name in ("scale", "iterations"):
            assert step[name][0] == step[name][1], (name, t)
        for got, expected in zip(step["variables"], want["variables"]):
            np.testing.assert_allclose(got[0], expected, rtol=1e-6, atol=1e-7)
        assert step["scale"][0] == want["scale"], t
        assert step["iterations"][0] == want["iterations"], t
    # Three overflows, each on one replica only, each skipped by both.
    iterations = [step["iterations"][0] for step in result["history"]]
    assert iterations == [1, 1, 2, 2, 3, 4, 4, 5]


def test_the_step_takes_no_merge_call(results):
    # MirroredStrategy under XLA on GPUs runs without merge_call (Keras's
    # wrapper crashes there, keras-team/keras#21366): the worker switches
    # the strategy into that mode on CPU and makes merge_call raise.
    result = results["no_merge_call"]
    iterations = [step["iterations"] for step in result["history"]]
    assert iterations == [[i, i] for i in (1, 1, 2, 2, 3, 4, 4, 5)]
    for step, want in zip(result["history"], result["reference"]):
        np.testing.assert_array_equal(*step["variables"][0])
        np.testing.assert_allclose(step["variables"][0][0], want["variables"][0], rtol=1e-6)


def test_jit_compile_under_a_one_device_strategy(results):
    result = results["xla_one_device"]
    assert result["traces"] == 1
    # One replica: replica 1's overflows do not happen, replica 0's does.
    iterations = [step["iterations"][0] for step in result["history"]]
    assert iterations == [1, 2, 3, 3, 4, 5, 6, 7]
    for step, want in zip(result["history"], result["reference"]):
        np.testing.assert_allclose(step["variables"][0][0], want["variables"][0], rtol=1e-5)
        assert step["scale"][0] == want["scale"]


def test_jit_compile_over_two_logical_cpus_is_refused_by_xla(results):
    # What CPU allows: XLA on CPU cannot reach a variable on another
    # (logical) device, so a jit-compiled step over two CPU replicas fails in
    # TensorFlow itself, before any optimizer code runs (docs/tensorflow.md).
    error = results["xla_two_devices"]["error"]
    assert error is not None and "located in device" in error and "CPU:1" in error


def test_a_first_apply_inside_strategy_run_asks_to_build_first(results):
    result = results["lazy_build"]
    assert not result["built"]
    assert (
        "build the optimizer first, e.g. `optimizer.build(model.trainable_variables)`"
        in (result["error"])
    )


def test_outside_any_strategy_the_flags_pass_through():
    flag = tf.constant(False)
    peak = tf.constant(3.0)
    assert replicas.all_true(flag) is flag
    assert replicas.all_max(peak) is peak


def test_process_group_is_refused():
    with pytest.raises(
        ValueError,
        match=r"`process_group` applies to torch.distributed only; on TensorFlow the replicas "
        r"of the current tf.distribute strategy agree on every skip\. Received: process_group=7",
    ):
        replicas.all_true(tf.constant(True), group=7)
    with pytest.raises(ValueError, match="process_group=7"):
        replicas.all_max(tf.constant(1.0), group=7)
