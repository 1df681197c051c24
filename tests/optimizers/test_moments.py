"""The Adam family's shared pieces, on every backend, against float64 NumPy."""

import math

import numpy as np
import pytest

import lossscale as ls
from lossscale.optimizers import Adam, moments


def _built(backend, rng, **kwargs):
    """An Adam built on two random variables (shapes (3, 2) and (4,))."""
    variables = [
        ls.Variable(backend.array(rng.normal(size=s)), name=f"w{i}")
        for i, s in enumerate([(3, 2), (4,)])
    ]
    opt = Adam(**kwargs)
    opt.build(variables)
    return opt, variables


def test_check_rates_accepts_the_edges_of_each_range():
    assert moments.check_rates(0, 0, 1e-30) is None
    assert moments.check_rates(0.999999, 0.5, 1.0) is None


@pytest.mark.parametrize(
    "args, message",
    [
        ((1.0, 0.9, 1e-7), "`beta_1` must be a finite number >= 0 and < 1. Received: beta_1=1.0"),
        ((-0.1, 0.9, 1e-7), "`beta_1` must be a finite number >= 0 and < 1. Received: beta_1=-0.1"),
        (
            (math.nan, 0.9, 1e-7),
            "`beta_1` must be a finite number >= 0 and < 1. Received: beta_1=nan",
        ),
        ((True, 0.9, 1e-7), "`beta_1` must be a finite number >= 0 and < 1. Received: beta_1=True"),
        ((0.9, 1, 1e-7), "`beta_2` must be a finite number >= 0 and < 1. Received: beta_2=1"),
        ((0.9, None, 1e-7), "`beta_2` must be a finite number >= 0 and < 1. Received: beta_2=None"),
        ((0.9, 0.9, 0), "`epsilon` must be a finite number > 0. Received: epsilon=0"),
        ((0.9, 0.9, "1e-7"), "`epsilon` must be a finite number > 0. Received: epsilon='1e-7'"),
        # Several bad arguments: the first in signature order is named.
        ((2.0, -1.0, 0), "`beta_1` must be a finite number >= 0 and < 1. Received: beta_1=2.0"),
        ((0.9, -1.0, 0), "`beta_2` must be a finite number >= 0 and < 1. Received: beta_2=-1.0"),
    ],
)
def test_check_rates_messages(args, message):
    with pytest.raises(ValueError) as info:
        moments.check_rates(*args)
    assert str(info.value) == message


def test_add_moments_makes_a_momentum_and_a_velocity_per_variable(backend, rng):
    variables = [
        ls.Variable(backend.array(rng.normal(size=(3, 2))), name="kernel"),
        ls.Variable(
            backend.array(rng.normal(size=(2,))), name="step", overwrite_with_gradient=True
        ),
        ls.Variable(backend.array(rng.normal(size=(4,)), dtype="float16"), name="bias"),
    ]
    opt = Adam()
    opt.build(variables)
    before = len(opt.variables)
    momentums, velocities = moments.add_moments(opt, variables)
    assert momentums[1] is None and velocities[1] is None
    made = [momentums[0], velocities[0], momentums[2], velocities[2]]
    assert opt.variables[before:] == made
    assert [v.name for v in made] == [
        "kernel_momentum",
        "kernel_velocity",
        "bias_momentum",
        "bias_velocity",
    ]
    for slot, like in zip(made, [variables[0]] * 2 + [variables[2]] * 2):
        assert (slot.shape, slot.dtype) == (like.shape, like.dtype)
        assert type(slot.value) is type(like.value)
        np.testing.assert_array_equal(backend.numpy(slot), np.zeros(like.shape))


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-6), ("float16", 1e-3)])
def test_powers_at_step_raise_each_beta_to_the_step_being_taken(backend, rng, dtype, rtol):
    opt, _ = _built(backend, rng)
    (first,) = moments.powers_at_step(opt, dtype, 0.9)
    np.testing.assert_allclose(backend.numpy(first), 0.9, rtol=rtol)
    opt.iterations = 4
    powers = moments.powers_at_step(opt, dtype, 0.9, 0.999, 0.5)
    assert len(powers) == 3
    for power, beta in zip(powers, [0.9, 0.999, 0.5]):
        assert backend.numpy(power).dtype == np.dtype(dtype)
        np.testing.assert_allclose(backend.numpy(power), beta**5, rtol=rtol)


def test_update_average_moves_toward_the_value(backend, rng):
    opt, variables = _built(backend, rng)
    average = opt._momentums[0]
    expected = np.zeros((3, 2))
    for _ in range(3):
        value = rng.normal(size=(3, 2))
        moments.update_average(opt, average, backend.array(value), 0.8)
        expected += (value.astype(np.float32) - expected) * (1 - 0.8)
        np.testing.assert_allclose(backend.numpy(average), expected, rtol=1e-6, atol=1e-7)


def test_update_moments_follow_the_adam_averages(backend, rng):
    opt, _ = _built(backend, rng, beta_1=0.6, beta_2=0.75)
    m, v = opt._momentums[1], opt._velocities[1]
    expected_m, expected_v = np.zeros(4), np.zeros(4)
    for _ in range(3):
        g = rng.normal(size=(4,)).astype(np.float32)
        moments.update_moments(opt, m, v, backend.array(g))
        expected_m = expected_m + (g - expected_m) * (1 - 0.6)
        expected_v = expected_v + (np.square(g.astype(np.float64)) - expected_v) * (1 - 0.75)
        np.testing.assert_allclose(backend.numpy(m), expected_m, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(backend.numpy(v), expected_v, rtol=1e-6, atol=1e-7)
    # The other variable's slots are untouched.
    np.testing.assert_array_equal(backend.numpy(opt._momentums[0]), np.zeros((3, 2)))
    np.testing.assert_array_equal(backend.numpy(opt._velocities[0]), np.zeros((3, 2)))
