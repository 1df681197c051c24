"""Gradient-accumulation helpers."""

import numpy as np
import pytest

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.optimizers import accumulation
from tests.conftest import BACKENDS, Backend


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


MODES = [(b, m) for b in BACKENDS for m in ("stateful", "stateless")] + [("jax", "jit")]


@pytest.mark.filterwarnings("ignore:Gradients do not exist")
@pytest.mark.parametrize("name,mode", MODES)
def test_an_update_step_ends_every_window(name, mode):
    """Keras's rule: a variable without a gradient at an update step loses its
    partial sum (the second variable ends at 1 - (100 + 100) / 2 = -99, not
    1 - (10 + 100 + 100) / 2 = -104)."""
    backend = Backend(name)
    weights = [backend.array(np.ones(2, np.float32)) for _ in range(2)]
    opt = ls.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    steps = [(1.0, 10.0), (1.0, None), (1.0, 100.0), (1.0, 100.0)]

    def grads(step):
        return [None if g is None else backend.array(np.full(2, g, np.float32)) for g in step]

    if mode == "stateful":
        variables = [ls.Variable(w) for w in weights]
        for step in steps:
            opt.apply(grads(step), variables)
        values = [backend.numpy(v.value) for v in variables]
    else:
        opt.build([ls.Variable(w) for w in weights])
        apply = opt.stateless_apply
        if mode == "jit":
            import jax

            apply = jax.jit(apply)
        state, values = [v.value for v in opt.variables], weights
        for step in steps:
            values, state = apply(state, grads(step), values)
        values = [backend.numpy(v) for v in values]
        accumulators = [
            backend.numpy(x) for v, x in zip(opt.variables, state) if "accumulator" in v.name
        ]
        assert [a.tolist() for a in accumulators] == [[0.0, 0.0], [0.0, 0.0]]
    assert [v.tolist() for v in values] == [[-1.0, -1.0], [-99.0, -99.0]]
