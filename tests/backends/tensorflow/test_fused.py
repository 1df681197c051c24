"""SGD on TensorFlow's fused kernels equals `SGD.update_step` bit for bit."""

import numpy as np
import pytest
import tensorflow as tf

import lossscale as ls
from lossscale.backends.tensorflow import fused

SETTINGS = [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}]
IDS = ["plain", "momentum", "nesterov"]


def _steps(settings, dtype, rule, graph=False, steps=4):
    rng = np.random.default_rng(3)
    variables = [
        ls.Variable(tf.Variable(rng.normal(size=s).astype(dtype)), name=f"w{i}")
        for i, s in enumerate([(5, 3), (3,)])
    ]
    opt = ls.optimizers.SGD(0.05, **settings)
    opt.build(variables)
    lr = tf.constant(0.05)

    def step(grads):
        if rule == "fused":
            hyper = opt._hyper_type(*(getattr(opt, k) for k in opt._hyper_type._fields))
            slots = opt._kernel_slots(variables)
            fused.sgd(opt.update_step, variables, slots, hyper, grads, lr)
        else:
            for g, v in zip(grads, variables):
                opt.update_step(g, v, lr)

    if graph:
        step = tf.function(step)
    for _ in range(steps):
        step([tf.constant(rng.normal(size=v.shape).astype(dtype)) for v in variables])
    return [v.numpy() for v in variables + opt.variables]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_fused_sgd_equals_update_step(settings, dtype, graph):
    reference = _steps(settings, dtype, "update_step", graph)
    for got, want in zip(_steps(settings, dtype, "fused", graph), reference):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_half_precision_and_tensor_bound_variables_take_update_step():
    reference = _steps(SETTINGS[1], np.float16, "update_step")
    for got, want in zip(_steps(SETTINGS[1], np.float16, "fused"), reference):
        np.testing.assert_array_equal(got, want)
    v = ls.Variable(tf.Variable(np.ones(2, np.float32)))
    opt = ls.optimizers.SGD(0.1, momentum=0.9)
    opt.build([v])
    slots = opt._kernel_slots([v])
    assert fused._fusable([v], slots)
    # `stateless_apply` binds plain tensors: no handle for the fused kernels.
    with ls.backends._common.bound([v], [tf.constant([1.0, 1.0])]):
        assert not fused._fusable([v], slots)
