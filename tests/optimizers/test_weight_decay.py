"""Decoupled weight decay and its exclusions."""

import numpy as np

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.optimizers.weight_decay import WeightDecayExclusions, apply_weight_decay


def test_decay_and_exclusions(backend):
    ops = get_ops(backend.name)
    kernel = ls.Variable(backend.array(np.array([2.0, -4.0])), name="dense_kernel")
    bias = ls.Variable(backend.array(np.array([1.0])), name="dense_bias")
    gamma = ls.Variable(backend.array(np.array([1.0])), name="norm_gamma")
    exclusions = WeightDecayExclusions(var_list=[gamma], var_names=["bias"])
    cache = {}  # an optimizer's kernel cache: a backend kernel keeps its tensor lists there
    lr = backend.array(np.float32(0.1))
    apply_weight_decay(ops, [kernel, bias, gamma], 0.5, lr, exclusions, cache)
    np.testing.assert_allclose(backend.numpy(kernel), [1.9, -3.8], rtol=1e-6)
    assert backend.numpy(bias).tolist() == [1.0] and backend.numpy(gamma).tolist() == [1.0]


def test_no_exclusions_by_default():
    assert WeightDecayExclusions().uses_weight_decay(ls.Variable(np.zeros(1), name="bias"))
