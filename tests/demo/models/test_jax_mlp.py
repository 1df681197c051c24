"""demo/models/jax_mlp.py: the network under `jax.grad` and `jax.jit` trains, in float32 and float16."""

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
    check_gradients_have_the_variables_shapes_and_the_pass_dtype("jax", precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_lowers_the_loss(precision):
    check_training_lowers_the_loss("jax", precision)


def test_single_threaded_limits_the_pools_and_restores_them():
    check_single_threaded_limits_the_pools_and_restores_them("jax")


def test_an_update_rebinds_the_variables_to_new_arrays():
    import jax
    import numpy as np

    import lossscale as ls

    net = model("jax")
    before = [v.value for v in net.variables]
    _, grads = net.gradients(*batch(), "float32", 1.0, lambda loss: loss)
    ls.optimizers.SGD(learning_rate=0.1).apply(grads, net.variables)
    for v, old, g in zip(net.variables, before, grads, strict=True):
        assert isinstance(v.value, jax.Array) and v.value is not old
        np.testing.assert_allclose(v.value, old - 0.1 * g, rtol=1e-6, atol=1e-7)
