"""The TensorFlow backend's storage and writes, and bad input on TensorFlow.

A `Variable` holds a `tf.Variable`: a user's, wrapped without copying, or
one made for it; writes cast and broadcast like the other backends'
in-place writes; under a mask they keep every old bit. Bad input (mixed
backends, integer trainable variables, wrong shapes) fails before anything
is written.
"""

import numpy as np
import pytest
import tensorflow as tf
import torch

import lossscale as ls
from lossscale.backends import backend_of
from lossscale.backends.tensorflow import ops

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


def test_tensors_and_variables_are_tensorflow():
    assert backend_of(tf.constant([1.0])) == "tensorflow"
    assert backend_of(tf.Variable([1.0])) == "tensorflow"
    assert ops.is_native(tf.constant(1)) and not ops.is_native(np.ones(1))


def test_a_model_variable_is_wrapped_without_copying_and_trained_in_place():
    w = tf.Variable(np.array([1.0, -2.0], np.float32), name="kernel")
    v = ls.Variable(w)
    assert v.storage is w and v.trainable and v.dtype == "float32" and v.shape == (2,)
    ls.optimizers.SGD(0.5).apply([tf.constant([1.0, 1.0])], [w])
    np.testing.assert_array_equal(w.numpy(), [0.5, -2.5])  # the user's own tf.Variable


def test_a_tensor_or_an_initializer_gets_a_tf_variable_of_its_own():
    t = tf.constant([1.0, 2.0])
    v = ls.Variable(t, name="bias term")
    assert isinstance(v.storage, tf.Variable) and v.storage.trainable
    assert v.storage.name.startswith("bias_term")  # TensorFlow's name rules
    v.assign_add(tf.ones(2))
    np.testing.assert_array_equal(t.numpy(), [1.0, 2.0])  # tensors are immutable
    slot = ls.Variable("zeros", shape=(3,), trainable=False, backend="tensorflow")
    assert isinstance(slot.storage, tf.Variable) and not slot.storage.trainable


def test_optimizer_state_is_tf_variables_made_outside_the_trace():
    w = tf.Variable(np.ones((2, 2), np.float32))
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam())
    tf.function(lambda: opt.build([w]))()
    assert all(isinstance(v.storage, tf.Variable) for v in opt.variables)
    assert [v.dtype for v in opt.variables[:4]] == ["int32", "float32", "int32", "float32"]
    assert all(not v.storage.trainable for v in opt.variables)


def test_a_symbolic_tensor_cannot_become_a_variable():
    @tf.function
    def make(x):
        ls.Variable(x)

    with pytest.raises(
        ValueError,
        match=r"A lossscale.Variable cannot be made from a tensor inside a tf.function being "
        r"traced: .* Received: a symbolic tf.Tensor of shape \(2,\)",
    ):
        make(tf.ones(2))


def test_reading_a_symbolic_value_on_the_host_is_a_clear_error():
    @tf.function
    def read(x):
        ops.to_numpy(x)

    with pytest.raises(ValueError, match=r"has no NumPy value yet: read it outside the function"):
        read(tf.ones(3))


def test_writes_cast_and_broadcast_to_the_storage():
    storage = tf.Variable(np.zeros(3, np.float32))
    assert ops.assign(storage, 2.5) is storage  # in place
    ops.assign_add(storage, np.array([1.0, 2.0, 3.0]))  # float64 NumPy into float32
    ops.assign_sub(storage, tf.constant(0.5, tf.float64))
    np.testing.assert_array_equal(storage.numpy(), [3.0, 4.0, 5.0])
    counter = tf.Variable(np.int32(4))
    ops.assign_add(counter, 1)
    assert counter.numpy() == 5 and counter.dtype == tf.int32


def test_writes_to_a_tensor_return_a_new_tensor():
    storage = tf.constant([1.0, 2.0], tf.float16)
    new = ops.assign_add(storage, tf.constant([1.0, 1.0]))
    assert new is not storage and new.dtype == tf.float16
    np.testing.assert_array_equal(new.numpy(), [2.0, 3.0])
    np.testing.assert_array_equal(storage.numpy(), [1.0, 2.0])


def test_mixing_tensorflow_with_another_backend_names_both():
    with pytest.raises(ValueError, match="found both 'tensorflow' and 'torch'"):
        ls.optimizers.Adam().build([tf.Variable([1.0]), torch.ones(1)])
    w = tf.Variable([1.0, 2.0])
    opt = ls.optimizers.Adam()
    with pytest.raises(
        ValueError,
        match=r"The gradient for variable 'param_0' is a torch array but the variables are "
        r"tensorflow arrays; all must come from one backend\. Received: Tensor",
    ):
        opt.apply([torch.ones(2)], [w])
    assert not opt.built and w.numpy().tolist() == [1.0, 2.0]


def test_a_non_float_trainable_variable_is_refused_before_anything_is_written():
    w, steps = tf.Variable([1.0, 2.0]), tf.Variable([3, 4])
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam())
    with pytest.raises(
        ValueError,
        match=r"`var_list` must hold real floating-point variables: the update rules train "
        r"neither integers, booleans nor complex numbers\. Received: variable 'param_1' of "
        r"dtype int32",
    ):
        opt.apply([tf.ones(2), tf.ones(2, tf.int32)], [w, steps])
    assert not opt.built and w.numpy().tolist() == [1.0, 2.0] and steps.numpy().tolist() == [3, 4]


def test_a_gradient_of_another_shape_is_refused_before_anything_is_written():
    w = tf.Variable(np.ones((2, 3), np.float32), name="kernel")
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam(), initial_scale=2.0)
    opt.apply([tf.ones((2, 3))], [w])
    before = [v.numpy() for v in opt.variables] + [w.numpy()]
    with pytest.raises(
        ValueError,
        match=r"The gradient for variable 'param_0' must have the variable's shape \(2, 3\)\. "
        r"Received: gradient shape \(3, 2\)",
    ):
        opt.apply([tf.ones((3, 2))], [w])
    for got, want in zip([v.numpy() for v in opt.variables] + [w.numpy()], before):
        np.testing.assert_array_equal(got, want)


def test_autograph_calls_lossscale_as_written():
    """lossscale is on autograph's list of libraries it does not rewrite, as Keras is.

    A step traced in a `tf.function` then runs lossscale's code as written
    (its branches on tensors are `cond`s already), and a user's own code is
    still rewritten.
    """
    from tensorflow.python.autograph.core import config
    from tensorflow.python.autograph.impl import conversion

    assert conversion.is_allowlisted(ls.LossScaleOptimizer.apply)
    assert conversion.is_allowlisted(ops.assign)
    assert sum(r.matches("lossscale") for r in config.CONVERSION_RULES) == 1

    def users_step(x):
        if x > 0:  # a Python `if` on a tensor: rewritten into a graph branch
            return x
        return -x

    assert not conversion.is_allowlisted(users_step)
    v = ls.Variable(tf.constant([1.0, -2.0]))
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.5), initial_scale=4.0)
    opt.build([v])

    @tf.function
    def step(g):
        grad = users_step(g) * tf.constant([1.0, 2.0]) * opt.scale_loss(tf.constant(1.0))
        opt.apply([grad], [v])

    step(tf.constant(-2.0))
    np.testing.assert_array_equal(ops.to_numpy(v.value), [0.0, -4.0])
    assert int(opt.iterations) == 1


def test_a_sparse_gradient_is_read_dense_with_its_repeated_rows_summed():
    # What an op on an embedding's gradient (a measurement, a peak) reads.
    from lossscale.backends import get_ops
    from lossscale.mixed_precision import diagnostics

    rng = np.random.default_rng(6)
    indices = rng.integers(0, 40, size=3000).astype(np.int32)  # repeats
    values = (rng.normal(size=(3000, 32)) * 2.0**-14).astype(np.float32)
    sparse = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([5000, 32]))
    dense = np.zeros((5000, 32), np.float64)
    np.add.at(dense, indices, values.astype(np.float64))
    np.testing.assert_allclose(ops.cast(sparse, "float32").numpy(), dense, rtol=0, atol=1e-9)
    backend = get_ops("tensorflow")
    ours = diagnostics.measure_all(backend, [sparse], 2.0)
    theirs = diagnostics.measure_all(backend, [tf.convert_to_tensor(sparse)], 2.0)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert float(ours[0][0]) > 0.99  # untouched rows count as zeros
