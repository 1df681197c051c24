"""demo/models/tensorflow_mlp.py: the network on `tf.Variable`s under `tf.GradientTape` trains, in float32 and float16."""

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
    check_gradients_have_the_variables_shapes_and_the_pass_dtype("tensorflow", precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_lowers_the_loss(precision):
    check_training_lowers_the_loss("tensorflow", precision)


def test_single_threaded_limits_the_pools_and_restores_them():
    check_single_threaded_limits_the_pools_and_restores_them("tensorflow")


def test_tensorflow_variables_hold_tf_variables_updated_in_place():
    import numpy as np
    import tensorflow as tf

    net = model("tensorflow")
    storages = [v.storage for v in net.variables]
    assert all(isinstance(s, tf.Variable) for s in storages)
    net.variables[1].assign(np.ones(16, np.float32))
    assert net.variables[1].storage is storages[1]
    np.testing.assert_array_equal(storages[1].numpy(), np.ones(16, np.float32))


def test_one_traced_function_serves_every_loss_scale():
    from lossscale.demo.models import tensorflow_mlp

    net = model("tensorflow")
    x, y = batch()
    net.gradients(x, y, "float16", 1.0, lambda loss: loss * 2.0)
    traced = tensorflow_mlp._gradients.experimental_get_tracing_count()
    for scale in (4.0, 2.0**10, 2.0**15):
        net.gradients(x, y, "float16", 0.5, lambda loss, s=scale: loss * s)
    assert tensorflow_mlp._gradients.experimental_get_tracing_count() == traced
