"""Decoupled weight decay and its exclusions."""

import numpy as np

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.optimizers.weight_decay import (
    WeightDecayExclusions,
    apply_weight_decay,
    partition_by_decay,
)


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


def test_partition_by_decay_on_each_side_of_the_no_exclusion_shortcut():
    variables = [ls.Variable(np.zeros(1), name=n) for n in ("kernel", "bias", "gamma", "w")]
    none = WeightDecayExclusions()
    assert not none.excludes_any()
    decayed, excluded = partition_by_decay(variables, none)
    assert list(decayed) == [0, 1, 2, 3] and list(excluded) == []
    some = WeightDecayExclusions(var_list=[variables[2]], var_names=["bias"])
    assert some.excludes_any()
    assert partition_by_decay(variables, some) == ([0, 3], [1, 2])
    by_name = WeightDecayExclusions(var_names=["w"])  # a search: "w" is not in "kernel"
    assert by_name.excludes_any() and partition_by_decay(variables, by_name) == ([0, 1, 2], [3])
