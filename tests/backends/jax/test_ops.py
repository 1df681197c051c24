"""The JAX backend module: dtype and weak-type keeping writes, placement, cond."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale as ls
from lossscale.backends.jax import ops as jax_ops


def weak(x):
    return bool(x.weak_type)


@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
def test_writes_keep_dtype_and_weak_type(method):
    write = getattr(jax_ops, method)
    strong_value = jnp.asarray(np.float32(2.0))
    weak_storage = jnp.asarray(1.0)  # a Python float: weakly typed float32
    assert weak(weak_storage) and not weak(strong_value)
    out = write(weak_storage, strong_value)
    assert out.dtype == jnp.float32 and weak(out)
    expected = {"assign": 2.0, "assign_add": 3.0, "assign_sub": -1.0}[method]
    assert float(out) == expected
    strong_storage = jnp.asarray(np.float32(1.0))
    out = write(strong_storage, 2.0)
    assert out.dtype == jnp.float32 and not weak(out) and float(out) == expected
    # An integer storage stays integer whatever is written into it.
    out = write(jnp.asarray(np.int32(1)), jnp.asarray(np.float32(2.0)))
    assert out.dtype == jnp.int32 and int(out) == int(expected)
    # A weakly typed array with a shape keeps its weak type too.
    vector = jnp.broadcast_to(jnp.asarray(1.0), (3,))
    out = write(vector, jnp.full((3,), 2.0, jnp.float32))
    assert weak(out) and out.shape == (3,) and np.all(np.asarray(out) == expected)


def test_writes_keep_weak_type_under_jit():
    out = jax.jit(lambda s, v: jax_ops.assign_add(s, v))(jnp.asarray(1.0), jnp.float32(2.0))
    assert weak(out) and float(out) == 3.0


def test_assign_broadcasts_a_scalar_into_the_shape():
    out = jax_ops.assign(jnp.zeros((2, 3), jnp.float32), 4.0)
    assert out.shape == (2, 3) and out.dtype == jnp.float32 and np.all(np.asarray(out) == 4.0)


def test_new_arrays_follow_a_committed_reference():
    device = jax.devices()[0]
    committed = jax.device_put(jnp.ones((2, 2)), device)
    for made in (
        jax_ops.asarray(np.zeros((2, 2), np.float32), like=committed),
        jax_ops.full((2, 2), 1.0, "float32", like=committed),
        jax_ops.full((), 0, "int32", like=committed),
        jax_ops.place(np.ones(5, np.float32), committed),
    ):
        assert made.committed and made.sharding.device_set == {device}
    # Default placement stays uncommitted: nothing to follow.
    assert not jax_ops.asarray(np.zeros(2), like=jnp.ones(2)).committed
    assert not jax_ops.asarray(np.zeros(2)).committed
    # A traced reference carries no placement.
    out = jax.jit(lambda x: jax_ops.full((2,), 3.0, "float32", like=x))(committed)
    assert np.asarray(out).tolist() == [3.0, 3.0]


def test_shape_and_dtype_of_a_donated_array():
    x = jnp.ones((2, 3), jnp.bfloat16)
    jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    assert x.is_deleted()
    assert jax_ops.shape(x) == (2, 3) and jax_ops.dtype_name(x) == "bfloat16"


def _counter_variables():
    a = ls.Variable(jnp.asarray(np.float32(1.0)), name="a")
    b = ls.Variable(jnp.asarray(np.int32(5)), name="b")
    return a, b


def test_cond_on_a_concrete_predicate_runs_one_branch():
    a, b = _counter_variables()
    calls = []

    def true_fn():
        calls.append("true")
        a.assign_add(1.0)

    def false_fn():
        calls.append("false")
        b.assign(0)

    jax_ops.cond(jnp.asarray(False), true_fn, false_fn, [a, b])
    assert calls == ["false"] and float(a.value) == 1.0 and int(b.value) == 0


@pytest.mark.parametrize("pred", [True, False])
def test_cond_under_jit_selects_and_keeps_types(pred):
    a, b = _counter_variables()

    def step(p, a_value, b_value):
        with ls.backends._common.bound([a, b], [a_value, b_value]):
            jax_ops.cond(
                p, lambda: (a.assign(a.value * 3.0), b.assign_add(1)), lambda: a.assign(0.5), [a, b]
            )
            return a.value, b.value

    new_a, new_b = jax.jit(step)(jnp.asarray(pred), jnp.asarray(2.0), jnp.asarray(np.int32(7)))
    assert weak(new_a) and new_a.dtype == jnp.float32 and new_b.dtype == jnp.int32
    assert (float(new_a), int(new_b)) == ((6.0, 8) if pred else (0.5, 7))
    # Nothing traced leaks into the variables.
    assert float(a.value) == 1.0 and int(b.value) == 5


def test_stateful_variable_rebinds_and_leaves_the_wrapped_array_alone():
    original = jnp.asarray(np.array([1.0, 2.0], np.float32))
    v = ls.Variable(original)
    v.assign_add(jnp.ones(2))
    assert np.asarray(original).tolist() == [1.0, 2.0]
    assert v.numpy().tolist() == [2.0, 3.0] and v.value is not original
