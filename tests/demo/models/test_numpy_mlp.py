"""demo/models/numpy_mlp.py: the hand-differentiated network trains, in float32 and float16."""

import pytest

from tests.demo_model_cases import (
    batch,
    check_gradients_have_the_variables_shapes_and_the_pass_dtype,
    check_single_threaded_limits_the_pools_and_restores_them,
    check_training_lowers_the_loss,
    model,
)

PRECISIONS = ["float32", "float16"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gradients_have_the_variables_shapes_and_the_pass_dtype(precision):
    check_gradients_have_the_variables_shapes_and_the_pass_dtype("numpy", precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_lowers_the_loss(precision):
    check_training_lowers_the_loss("numpy", precision)


def test_single_threaded_limits_the_pools_and_restores_them():
    check_single_threaded_limits_the_pools_and_restores_them("numpy")


def test_float16_overflow_gives_infinities_without_warnings():
    import warnings

    import numpy as np

    x, y = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, grads = model("numpy").gradients(x, y, "float16", 1.0, lambda loss: loss * 2.0**40)
    assert not all(np.isfinite(g).all() for g in grads)
