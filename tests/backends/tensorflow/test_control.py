"""Branches on device values: eager masked writes, `tf.cond` inside a graph.

Eagerly, nothing reads the predicate on the host: a whole loss-scaled step
runs with every host read of a tensor made to fail. In a graph, `cond` is
`tf.cond`: only the branch taken runs, for `tf.Variable`s and for
variables bound to tensors alike.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

import lossscale as ls
from lossscale.backends import _common
from lossscale.backends.tensorflow import control

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


def _variable(values):
    return ls.Variable(tf.Variable(np.asarray(values, np.float32)))


@pytest.mark.parametrize("pred", [True, False])
def test_eager_cond_writes_only_the_taken_branch(pred):
    v = _variable([1.0, -0.0])
    control.cond(
        tf.constant(pred),
        lambda: v.assign_add(tf.constant([1.0, 1.0])),
        lambda: v.assign(tf.constant([np.nan, np.nan])),
        [v],
    )
    expected = [2.0, 1.0] if pred else [np.nan, np.nan]
    np.testing.assert_array_equal(v.numpy(), expected)
    assert v.numpy().tobytes() != np.array([1.0, -0.0], np.float32).tobytes()


def test_the_eager_branch_not_taken_leaves_every_bit():
    old = np.array([-0.0, 0.0, 1.5], np.float32)
    v = _variable(old)
    for write in ("assign", "assign_add", "assign_sub"):
        control.cond(
            tf.constant(False),
            lambda write=write: getattr(v, write)(tf.constant([np.nan, 0.0, np.inf])),
            None,
            [v],
        )
    assert v.numpy().tobytes() == old.tobytes()  # -0.0 stays -0.0


def test_nested_eager_branches():
    v = _variable([0.0])
    for outer, inner, expected in [(True, True, 1), (True, False, 1), (False, True, 1)]:
        control.cond(
            tf.constant(outer),
            lambda inner=inner: control.cond(
                tf.constant(inner), lambda: v.assign_add(1.0), None, [v]
            ),
            None,
            [v],
        )
        assert v.numpy().tolist() == [expected]  # only the (True, True) step writes


def test_python_predicates_take_a_plain_if():
    v = _variable([0.0])
    control.cond(True, lambda: v.assign(5.0), lambda: v.assign(7.0), [v])
    control.cond(np.bool_(False), lambda: v.assign(9.0), None, [v])
    assert v.numpy().tolist() == [5.0]


@pytest.mark.parametrize("name", ["Adam", "SGD", "RMSprop"])
def test_an_eager_loss_scaled_step_reads_nothing_on_the_host(name):
    w = tf.Variable(np.ones((3, 2), np.float32))
    b = tf.Variable(np.zeros(2, np.float32))
    opt = ls.LossScaleOptimizer(getattr(ls.optimizers, name)(0.1), initial_scale=4.0)
    opt.build([w, b])
    grads = [tf.ones((3, 2)) * 4.0, tf.ones(2) * 4.0]
    bad = [tf.fill((3, 2), np.float32(np.inf)), tf.ones(2)]
    opt.apply(grads, [w, b])  # traces the compiled kernels, before the reads are refused
    with pytest.MonkeyPatch.context() as patch:

        def refuse(*args, **kwargs):
            raise AssertionError("a tensor was read on the host")

        for attr in ("__bool__", "__int__", "__float__", "__index__", "_numpy"):
            patch.setattr(tf_ops._EagerTensorBase, attr, refuse)
        opt.apply(bad, [w, b])
        opt.apply(grads, [w, b])
    assert int(opt.iterations) == 2 and float(opt.dynamic_scale) == 2.0


@pytest.mark.parametrize("pred", [True, False])
def test_graph_cond_writes_variables_and_carries_tensors(pred):
    held = _variable([1.0, 2.0])
    carried = _variable([10.0, 20.0])

    @tf.function
    def step(flag, value):
        with _common.bound([carried], [value]):
            control.cond(
                flag,
                lambda: (held.assign_add(1.0), carried.assign_add(1.0)),
                lambda: (held.assign(0.0), carried.assign(0.0)),
                [held, carried],
            )
            return carried.value

    out = step(tf.constant(pred), tf.constant([10.0, 20.0]))
    assert held.numpy().tolist() == ([2.0, 3.0] if pred else [0.0, 0.0])
    assert out.numpy().tolist() == ([11.0, 21.0] if pred else [0.0, 0.0])
    assert carried.numpy().tolist() == [10.0, 20.0]  # the binding was a copy


def test_graph_cond_runs_only_the_branch_taken():
    v = _variable([1.0])
    ran = tf.Variable(0)

    @tf.function(jit_compile=True)
    def step(flag):
        def expensive():
            ran.assign_add(1)
            v.assign(v.value * 3.0)

        control.cond(flag, expensive, None, [v])

    step(tf.constant(False))
    step(tf.constant(True))
    assert ran.numpy() == 1 and v.numpy().tolist() == [3.0]
