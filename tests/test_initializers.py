"""Initializer lookup."""

import numpy as np
import pytest

from lossscale import initializers


def test_builtin_names():
    np.testing.assert_array_equal(initializers.get("zeros")((2,), "float32"), [0, 0])
    np.testing.assert_array_equal(initializers.get("ones")((2,), "float32"), [1, 1])
    a = initializers.get("random_uniform")((1000,), "float32")
    assert a.dtype == np.float32 and -0.05 <= a.min() and a.max() <= 0.05 and a.std() > 0.02


def test_constant_and_callable():
    np.testing.assert_array_equal(initializers.get(7)((2,), "float32"), [7, 7])
    fn = lambda shape, dtype: np.full(shape, 3, dtype)  # noqa: E731
    assert initializers.get(fn) is fn


@pytest.mark.parametrize("bad", ["he_normal", None, True, [1, 2]])
def test_unknown_initializer(bad):
    with pytest.raises(ValueError, match="`initializer` must be one of"):
        initializers.get(bad)
