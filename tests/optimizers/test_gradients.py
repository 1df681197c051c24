"""Gradient checks: one rule for integer gradients on every backend, nothing written."""

import numpy as np
import pytest

import lossscale as ls
from lossscale.optimizers import SGD, Adam

MESSAGE = (
    r"The gradient for variable 'b' must have a floating-point dtype, as the variable does "
    r"\(float32\); integer and boolean gradients are not cast\. Received: gradient dtype {}"
)


def make(backend, rng):
    values = [rng.standard_normal((3, 4)), rng.standard_normal(5)]
    return [ls.Variable(backend.array(v), name=n) for v, n in zip(values, "wb")]


def snapshot(backend, variables):
    return [backend.numpy(v).copy() for v in variables]


def assert_unchanged(backend, before, variables):
    for b, v in zip(before, variables):
        np.testing.assert_array_equal(backend.numpy(v), b)


def bad_grads(backend, rng, dtype):
    good = backend.array(rng.standard_normal((3, 4)))
    bad = backend.array((rng.standard_normal(5) * 4).astype(dtype))
    return [good, bad]


@pytest.mark.parametrize("dtype", ["int32", "int16", "uint8", "bool"])
def test_an_integer_gradient_for_a_float_variable_is_refused_before_build(backend, rng, dtype):
    variables = make(backend, rng)
    before = snapshot(backend, variables)
    opt = Adam(learning_rate=0.1)
    with pytest.raises(ValueError, match=MESSAGE.format(dtype)):
        opt.apply(bad_grads(backend, rng, dtype), variables)
    assert not opt.built
    assert_unchanged(backend, before, variables)


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_an_integer_gradient_writes_nothing_after_a_step(backend, rng, dtype):
    variables = make(backend, rng)
    opt = ls.LossScaleOptimizer(Adam(learning_rate=0.1), initial_scale=8.0)
    opt.scale_loss(1.0)
    opt.apply([backend.array(rng.standard_normal(v.shape)) for v in variables], variables)
    state = variables + opt.variables
    before = snapshot(backend, state)
    with pytest.raises(ValueError, match=MESSAGE.format(dtype)):
        opt.apply(bad_grads(backend, rng, dtype), variables)
    assert_unchanged(backend, before, state)
    assert int(backend.numpy(opt.iterations)) == 1


def test_stateless_apply_refuses_an_integer_gradient(backend, rng):
    variables = make(backend, rng)
    opt = SGD(learning_rate=0.1, momentum=0.9)
    opt.build(variables)
    own = [v.value for v in opt.variables]
    with pytest.raises(ValueError, match=MESSAGE.format("int32")):
        opt.stateless_apply(own, bad_grads(backend, rng, "int32"), [v.value for v in variables])


def test_float_gradients_of_another_width_still_apply(backend, rng):
    # The rule is about kind: a float16 gradient for a float32 variable is cast, as before.
    variables = make(backend, rng)
    grads = [backend.array(rng.standard_normal(v.shape), dtype="float16") for v in variables]
    before = snapshot(backend, variables)
    SGD(learning_rate=0.5).apply(grads, variables)
    for b, g, v in zip(before, grads, variables):
        expected = b - np.float32(0.5) * backend.numpy(g).astype(np.float32)
        np.testing.assert_allclose(backend.numpy(v), expected, rtol=1e-6)
