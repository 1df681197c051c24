"""Shared checks for the learning-rate schedule tests (not a test module).

A schedule receives the optimizer's raw step on any backend (a Python int,
NumPy, torch or JAX integer array, or a JAX tracer under `jit`) and returns
a float32 scalar on that backend. Values are compared with a float64
formula written in each test module; near a zero learning rate float32
cancellation (`1 + cos(pi * x)` near x = 1) leaves absolute errors of a
few 1e-9, hence the small `atol`.
"""

import doctest
import json

import numpy as np

import lossscale as ls
from lossscale import serialization
from lossscale.backends import backend_of

RTOL, ATOL = 1e-5, 1e-8


def step_array(backend, step):
    """`step` as the backend's integer scalar, the dtype an optimizer's `iterations` has."""
    if backend.name == "jax":
        return backend.array(np.asarray(step, np.int32))
    return backend.array(np.asarray(step, np.int64))


def check_values(backend, schedule, reference, steps):
    """`schedule(step)` on `backend` is a float32 scalar equal to `reference(step)`."""
    for step in steps:
        value = schedule(step_array(backend, step))
        assert backend_of(value) == backend.name
        got = backend.numpy(value)
        assert got.dtype == np.float32 and got.shape == (), (got.dtype, got.shape)
        np.testing.assert_allclose(
            float(got), reference(step), rtol=RTOL, atol=ATOL, err_msg=f"step {step}"
        )


def check_python_steps(schedule, reference, steps):
    """A Python int step gives a NumPy float32 scalar."""
    for step in steps:
        value = schedule(step)
        assert backend_of(value) == "numpy"
        assert np.asarray(value).dtype == np.float32
        np.testing.assert_allclose(
            float(value), reference(step), rtol=RTOL, atol=ATOL, err_msg=f"step {step}"
        )


def check_jit(schedule, steps):
    """`jax.jit(schedule)` traces once (the step is a tracer) and equals the eager value."""
    import jax
    import jax.numpy as jnp

    traces = []

    def traced(step):
        traces.append(1)
        return schedule(step)

    jitted = jax.jit(traced)
    for step in steps:
        step = jnp.asarray(step, jnp.int32)
        # XLA may fuse and pick other float32 kernels than eager dispatch.
        np.testing.assert_allclose(
            float(jitted(step)), float(schedule(step)), rtol=RTOL, atol=ATOL, err_msg=f"step {step}"
        )
    assert len(traces) == 1


def check_config(schedule, steps):
    """`from_config(get_config())` and a JSON trip through `serialize` give the same schedule."""
    config = schedule.get_config()
    rebuilt = type(schedule).from_config(config)
    assert rebuilt.get_config() == config
    payload = json.loads(json.dumps(serialization.serialize(schedule)))
    assert payload["class_name"] == type(schedule).__name__
    again = ls.optimizers.deserialize(payload)
    assert type(again) is type(schedule) and again.get_config() == config
    for step in steps:
        assert float(again(step)) == float(schedule(step))


def check_in_optimizer(backend, schedule, reference, steps=6):
    """An optimizer follows the schedule, serializes it in its config and resumes with it.

    SGD makes the applied learning rate visible: `w -= lr(t) * g`.
    """
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=(4,)).astype(np.float32)
    grads = [rng.normal(size=(4,)).astype(np.float32) for _ in range(steps)]
    optimizer = ls.optimizers.SGD(learning_rate=schedule)
    w = ls.Variable(backend.array(w0), name="w")
    expected = w0.astype(np.float64)
    half = steps // 2
    for t, g in enumerate(grads[:half]):
        np.testing.assert_allclose(
            float(backend.numpy(optimizer.learning_rate)), reference(t), rtol=RTOL, atol=ATOL
        )
        optimizer.apply([backend.array(g)], [w])
        expected = expected - reference(t) * g
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-5, atol=1e-6)

    config = optimizer.get_config()
    assert config["learning_rate"] == serialization.serialize(schedule)
    json.dumps(config)
    store = {}
    optimizer.save_own_variables(store)
    resumed = ls.optimizers.SGD.from_config(config)
    assert type(resumed._learning_rate) is type(schedule)
    assert resumed._learning_rate.get_config() == schedule.get_config()
    w_resumed = ls.Variable(backend.array(w.numpy()), name="w")
    resumed.build([w_resumed])
    resumed.load_own_variables(store)
    for g in grads[half:]:
        optimizer.apply([backend.array(g)], [w])
        resumed.apply([backend.array(g)], [w_resumed])
    np.testing.assert_array_equal(w_resumed.numpy(), w.numpy())
    assert float(backend.numpy(resumed.learning_rate)) == float(
        backend.numpy(optimizer.learning_rate)
    )


def check_doctest(module):
    """The runnable example in `module`'s public docstrings holds."""
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
