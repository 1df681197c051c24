"""`lossscale.schedules._common`: the step conversion and config helpers the schedules share."""

import numpy as np

import lossscale as ls
from lossscale.backends import backend_of
from lossscale.schedules import _common


def test_float_step_keeps_the_backend(backend):
    for step in (
        backend.array(np.asarray(7, np.int32)),
        ls.Variable(backend.array(np.asarray(7, np.int64 if backend.name != "jax" else np.int32))),
    ):
        ops, value = _common.float_step(step)
        assert ops.NAME == backend.name and backend_of(value) == backend.name
        assert backend.numpy(value).dtype == np.float32 and float(backend.numpy(value)) == 7.0


def test_float_step_of_a_python_int_is_numpy():
    ops, value = _common.float_step(3)
    assert ops.NAME == "numpy" and value.dtype == np.float32 and float(value) == 3.0


def test_schedule_accepts_an_optimizer_iterations_variable(backend):
    optimizer = ls.optimizers.SGD(0.1)
    w = ls.Variable(backend.array(np.ones(2, np.float32)))
    for _ in range(3):
        optimizer.apply([backend.array(np.ones(2, np.float32))], [w])
    schedule = ls.schedules.ExponentialDecay(1.0, 1, 0.5)
    value = schedule(optimizer.iterations)
    assert backend_of(value) == backend.name
    assert float(backend.numpy(value)) == 0.125


def test_signature_config_reads_every_argument_in_order():
    schedule = ls.schedules.CosineDecay(0.1, 10, warmup_target=0.2)
    assert list(_common.signature_config(schedule).items()) == [
        ("initial_learning_rate", 0.1),
        ("decay_steps", 10),
        ("alpha", 0.0),
        ("name", "CosineDecay"),
        ("warmup_target", 0.2),
        ("warmup_steps", 0),
    ]
