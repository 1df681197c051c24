"""Gradient-accumulation helpers."""

import numpy as np

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.optimizers import accumulation


def test_accumulate_mean_reset(backend):
    ops = get_ops(backend.name)
    acc = ls.Variable(backend.array(np.array([1.0, 2.0])))
    g = backend.array(np.array([3.0, 4.0]))
    accumulation.accumulate([g], [acc])
    assert backend.numpy(acc).tolist() == [4.0, 6.0]
    mean = accumulation.mean_with_accumulated([g], [acc], 2)
    assert backend.numpy(mean[0]).tolist() == [3.5, 5.0]
    accumulation.reset(ops, [acc])
    assert backend.numpy(acc).tolist() == [0.0, 0.0]


def test_is_update_step():
    assert [bool(accumulation.is_update_step(np.int64(i), 3)) for i in range(6)] == [
        False,
        False,
        True,
        False,
        False,
        True,
    ]


def test_overwrite_with_max(backend):
    ops = get_ops(backend.name)
    v = ls.Variable(backend.array(np.array([9.0, 9.0])))
    acc = ls.Variable(backend.array(np.array([1.0, 5.0])))
    accumulation.overwrite_with_max(
        ops, v, backend.array(np.array([2.0, 3.0])), acc, backend.array(np.array(False))
    )
    assert backend.numpy(v).tolist() == [9.0, 9.0] and backend.numpy(acc).tolist() == [2.0, 5.0]
    accumulation.overwrite_with_max(
        ops, v, backend.array(np.array([0.0, 7.0])), acc, backend.array(np.array(True))
    )
    assert backend.numpy(v).tolist() == [2.0, 7.0] and backend.numpy(acc).tolist() == [0.0, 0.0]
