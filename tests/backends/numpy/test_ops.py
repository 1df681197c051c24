"""NumPy backend specifics: the one-pass finite check, unscale and max_abs.

Backend-neutral behaviour of the primitives is tested over every backend in
`test_backends.py`; this module covers what only the NumPy adapter does.
"""

import tracemalloc
import warnings

import numpy as np
import pytest

import lossscale as ls
from lossscale.backends.numpy import ops as ops
from tests.conftest import force_numpy_threads


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", [0, 17, -1])
def test_all_finite_finds_any_non_finite_value(rng, dtype, bad, where):
    arrays = [rng.standard_normal((4, 5)).astype(dtype), rng.standard_normal(40).astype(dtype)]
    assert ops.all_finite(arrays) == np.True_
    arrays[1][where] = bad
    result = ops.all_finite(arrays)
    assert isinstance(result, np.ndarray) and result.shape == () and result == np.False_


@pytest.mark.parametrize(
    "dtype,big", [("float32", 3e38), ("float32", 2e19), ("float64", 1e200), ("float16", 6e4)]
)
def test_all_finite_large_finite_values_are_finite(dtype, big):
    # Their sum of squares overflows; the exact check must still say finite,
    # without a warning about the overflow.
    a = np.full(1000, big, dtype=dtype)
    a[::2] *= -1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.all_finite([a]) == np.True_


def test_all_finite_strided_empty_scalar_integer_and_variables(rng):
    strided = rng.standard_normal((30, 20)).astype("float32")[:, ::3]
    assert (
        ops.all_finite(
            [
                strided,
                np.zeros((0, 4), "float32"),
                np.float32(2.0),
                np.arange(5),
                ls.Variable(np.ones(3, "float32")),
            ]
        )
        == np.True_
    )
    strided[7, 2] = np.nan
    assert ops.all_finite([strided]) == np.False_
    assert ops.all_finite([ls.Variable(np.array([1.0, np.inf], "float32"))]) == np.False_
    assert ops.all_finite([]) == np.True_


@pytest.mark.parametrize("big", [1.0, 1e30])
def test_all_finite_makes_no_boolean_copy(rng, big):
    a = (rng.standard_normal(1 << 20) * big).astype("float32")
    tracemalloc.start()
    try:
        assert ops.all_finite([a]) == np.True_
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < a.size // 8  # a boolean copy would take a.size bytes


def test_unscale_divides_and_widens_half_gradients(rng):
    g32 = rng.standard_normal((6, 7)).astype("float32")
    g16 = rng.standard_normal(9).astype("float16")
    before = [g32.copy(), g16.copy()]
    out = ops.unscale([g32, ls.Variable(g16)], np.asarray(np.float32(1024.0)))
    np.testing.assert_array_equal(out[0], g32 / np.float32(1024.0))
    assert out[1].dtype == np.float32
    np.testing.assert_array_equal(out[1], g16.astype("float32") / np.float32(1024.0))
    np.testing.assert_array_equal(g32, before[0])  # inputs untouched
    np.testing.assert_array_equal(g16, before[1])


def test_max_abs_propagates_nan_and_sees_negative_infinity():
    a = np.array([1.0, -7.5, 3.0], "float32")
    assert ops.max_abs([a, np.zeros(0, "float32"), np.array([2.0], "float64")]) == 7.5
    assert ops.max_abs([a, np.array([-np.inf], "float32")]) == np.inf
    assert np.isnan(ops.max_abs([np.array([np.nan, 1.0], "float32"), a]))
    assert ops.max_abs([]) == 0.0


@pytest.fixture(params=["default", "small_blocks"])
def reduce_blocks(request, monkeypatch):
    from lossscale.backends.numpy import parallel as numpy_parallel

    if request.param == "small_blocks":
        monkeypatch.setattr(numpy_parallel, "REDUCE_WHOLE_BELOW", 64)
        monkeypatch.setattr(numpy_parallel, "REDUCE_BLOCK", 100)
        force_numpy_threads(monkeypatch)
    return request.param


def _two_pass_max_abs(arrays):
    return max((float(np.maximum(np.max(a), -np.min(a))) for a in arrays if a.size), default=0.0)


@pytest.mark.parametrize(
    "bad,position", [(None, None), (np.nan, 0), (np.nan, 70_000), (np.inf, 131_071), (-np.inf, 5)]
)
def test_max_abs_of_large_arrays_in_blocks(rng, reduce_blocks, bad, position):
    arrays = [
        rng.standard_normal(1 << 17).astype("float32"),
        rng.standard_normal((300, 301)).astype("float32")[:, ::2],  # strided
        rng.standard_normal(70).astype("float64"),
        (rng.standard_normal((257, 255)) * 3).astype("float32"),
        np.zeros(0, "float32"),
    ]
    arrays[3][100, 7] = -40.5  # the peak is a negative value
    if bad is not None:
        arrays[0][position] = bad
    result = ops.max_abs(arrays)
    assert isinstance(result, np.ndarray) and result.shape == () and result.dtype == np.float32
    expected = _two_pass_max_abs(arrays)
    if bad is None:
        assert result == np.float32(40.5) == np.float32(expected)
    elif np.isnan(bad):
        assert np.isnan(result)
    else:
        assert result == np.inf


def test_max_abs_many_small_arrays_and_no_copy(rng):
    arrays = [rng.standard_normal(int(n)).astype("float32") for n in rng.integers(1, 300, 400)]
    arrays[123][4] = -9.0
    assert ops.max_abs(arrays) == np.float32(9.0)
    big = rng.standard_normal(1 << 20).astype("float32")
    tracemalloc.start()
    try:
        ops.max_abs([big])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < big.nbytes // 8
