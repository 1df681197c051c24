"""`Variable` on every backend."""

import numpy as np
import pytest

import lossscale as ls


def test_wraps_without_copy_and_assigns_in_place(backend):
    native = backend.array(np.array([1.0, 2.0, 3.0]))
    v = ls.Variable(native, name="w")
    assert v.shape == (3,) and v.dtype == "float32" and v.backend == backend.name
    assert v.name == "w" and v.path == "w" and v.trainable and v.ndim == 1
    v.assign(backend.array(np.array([4.0, 5.0, 6.0])))
    v.assign_add(backend.array(np.array([1.0, 1.0, 1.0])))
    v.assign_sub(backend.array(np.array([0.5, 0.5, 0.5])))
    np.testing.assert_array_equal(v.numpy(), [4.5, 5.5, 6.5])
    if backend.name != "jax":  # immutable arrays rebind instead
        np.testing.assert_array_equal(backend.numpy(native), [4.5, 5.5, 6.5])


def test_torch_parameter_identity_and_autograd():
    import torch

    p = torch.nn.Parameter(torch.ones(2))
    v = ls.Variable(p)
    v.assign_sub(torch.full((2,), 0.25))
    assert v.storage is p and p.requires_grad
    assert not v.value.requires_grad  # reads never record autograd history
    np.testing.assert_array_equal(p.detach().numpy(), [0.75, 0.75])


@pytest.mark.parametrize(
    "initializer, expected",
    [
        ("zeros", np.zeros((2, 2))),
        ("ones", np.ones((2, 2))),
        (2.5, np.full((2, 2), 2.5)),
        (lambda shape, dtype: np.arange(4, dtype=dtype).reshape(shape), np.arange(4).reshape(2, 2)),
    ],
)
def test_initializers(backend, initializer, expected):
    v = ls.Variable(initializer, shape=(2, 2), dtype="float32", backend=backend.name)
    assert v.backend == backend.name and v.dtype == "float32"
    np.testing.assert_array_equal(v.numpy(), expected)


def test_random_initializers_are_seeded_per_call_shape(backend):
    v = ls.Variable("random_normal", shape=(100,), backend=backend.name)
    assert 0.02 < float(np.std(v.numpy())) < 0.08


def test_like_places_on_backend(backend):
    v = ls.Variable("ones", shape=(3,), like=backend.array(np.zeros(1)))
    assert v.backend == backend.name


def test_python_values():
    assert ls.Variable(3.0).shape == () and ls.Variable(3.0).dtype == "float32"
    assert ls.Variable(0, dtype="int64").dtype == "int64"
    assert ls.Variable([1.0, 2.0]).dtype == "float32"


def test_dtype_conversion_and_numpy_assign(backend):
    v = ls.Variable(backend.array(np.array([1.0, 2.0])), dtype="float16")
    assert v.dtype == "float16"
    v.assign(np.array([3.0, 4.0], np.float32))  # NumPy values are accepted everywhere
    assert v.dtype == "float16" and v.backend == backend.name
    np.testing.assert_array_equal(v.numpy(), [3.0, 4.0])


def test_arithmetic_and_conversions(backend):
    v = ls.Variable(backend.array(np.array([2.0, 4.0])))
    for result, expected in [
        (v + 1, [3, 5]),
        (1 + v, [3, 5]),
        (v - 1, [1, 3]),
        (8 - v, [6, 4]),
        (v * 2, [4, 8]),
        (2 * v, [4, 8]),
        (v / 2, [1, 2]),
        (8 / v, [4, 2]),
        (v**2, [4, 16]),
        (-v, [-2, -4]),
        (v // 3, [0, 1]),
    ]:
        np.testing.assert_array_equal(backend.numpy(result), expected)
    assert bool(backend.numpy(v > 3)[1]) and np.asarray(v).tolist() == [2.0, 4.0]
    s = ls.Variable(backend.array(np.array(3.0)))
    assert float(s) == 3.0 and int(s) == 3
    np.testing.assert_array_equal(
        np.ones(2, np.float32) * ls.Variable(np.array([2.0, 3.0], np.float32)), [2, 3]
    )


def test_repr_names_everything():
    text = repr(ls.Variable(np.zeros(2, np.float32), name="bias"))
    assert "path=bias" in text and "shape=(2,)" in text and "dtype=float32" in text


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda v: v.assign(np.ones(3)),
            r"must match. variable.shape=\(2,\) \(path='w'\), Received: value.shape=\(3,\)",
        ),
        (lambda v: v.assign_add(np.ones((2, 2))), r"`variable.assign_add\(value\)` must match"),
    ],
)
def test_assign_shape_errors(backend, call, message):
    v = ls.Variable(backend.array(np.zeros(2)), name="w")
    with pytest.raises(ValueError, match=message):
        call(v)
    np.testing.assert_array_equal(v.numpy(), [0, 0])


def test_foreign_backend_value_rejected():
    import torch

    v = ls.Variable(np.zeros(2, np.float32), name="w")
    with pytest.raises(ValueError, match="got a torch array for a numpy variable"):
        v.assign(torch.ones(2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"initializer": "zeros"}, "`shape` is required"),
        (
            {"initializer": "glorot", "shape": (2,)},
            r"`initializer` must be one of .* Received: initializer='glorot'",
        ),
        ({"initializer": np.zeros(2), "shape": (3,)}, r"`shape` does not match"),
        ({"initializer": np.zeros(2), "aggregation": "max"}, r"`aggregation` must be one of"),
        ({"initializer": np.zeros(2), "name": 3}, r"`name` must be a string"),
        ({"initializer": np.zeros(2), "constraint": 3}, r"`constraint` must be callable"),
        (
            {"initializer": np.zeros(2), "backend": "torch"},
            r"`backend` is 'torch' but the wrapped array is a numpy array",
        ),
        ({"initializer": "zeros", "shape": (2,), "backend": "tf"}, r"`backend` must be one of"),
    ],
)
def test_constructor_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ls.Variable(**kwargs)


def test_initializer_wrong_shape():
    with pytest.raises(ValueError, match=r"initializer returned shape \(3,\), expected \(2,\)"):
        ls.Variable(lambda shape, dtype: np.zeros(3), shape=(2,))


def test_move_to_backend(backend):
    v = ls.Variable(0, dtype="int64")
    v.move_to(backend.array(np.zeros(1)))
    assert v.backend == backend.name and v.dtype.startswith("int")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_holds_its_own_array_on_the_same_backend(backend, how):
    import copy
    import pickle

    v = ls.Variable(backend.array(np.array([1.0, 2.0], np.float32)), name="kernel")
    c = copy.deepcopy(v) if how == "deepcopy" else pickle.loads(pickle.dumps(v))
    assert c._ops is v._ops and c.backend == backend.name  # the backend looked up again
    assert (c.name, c.path, c.shape, c.dtype) == (v.name, v.path, v.shape, v.dtype)
    c.assign_add(backend.array(np.array([1.0, 1.0], np.float32)))
    np.testing.assert_array_equal(backend.numpy(c), [2.0, 3.0])
    np.testing.assert_array_equal(backend.numpy(v), [1.0, 2.0])
