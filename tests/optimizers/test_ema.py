"""EMA helpers."""

import numpy as np
import pytest

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.optimizers import ema


def test_first_step_copies_then_averages(backend):
    ops = get_ops(backend.name)
    v = ls.Variable(backend.array(np.array([4.0])))
    avg = ls.Variable(backend.array(np.array([100.0])))
    ema.update_moving_averages(ops, [avg], [v], 0.75, backend.array(np.array(True)))
    assert backend.numpy(avg).tolist() == [4.0]
    v.assign(backend.array(np.array([8.0])))
    ema.update_moving_averages(ops, [avg, None], [v, v], 0.75, backend.array(np.array(False)))
    assert backend.numpy(avg).tolist() == [5.0]
    ema.overwrite_with_averages([v], [avg])
    assert backend.numpy(v).tolist() == [5.0]


def test_overwrite_length_mismatch():
    with pytest.raises(
        ValueError, match=r"length of model variables \(2\) to override does not match"
    ):
        ema.overwrite_with_averages([1, 2], [None])
