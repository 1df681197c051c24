"""Gradient checks: one rule for integer gradients on every backend, nothing written."""

import numpy as np
import pytest

import lossscale as ls
from lossscale.optimizers import SGD, Adam

MESSAGE = (
    r"The gradient for variable 'b' must have a floating-point dtype, as the variable does "
    r"\(float32\); integer and boolean gradients are not cast\. Received: gradient dtype {}"
)


def make(backend, rng):
    values = [rng.standard_normal((3, 4)), rng.standard_normal(5)]
    return [ls.Variable(backend.array(v), name=n) for v, n in zip(values, "wb")]


def snapshot(backend, variables):
    return [backend.numpy(v).copy() for v in variables]


def assert_unchanged(backend, before, variables):
    for b, v in zip(before, variables):
        np.testing.assert_array_equal(backend.numpy(v), b)


def bad_grads(backend, rng, dtype):
    good = backend.array(rng.standard_normal((3, 4)))
    bad = backend.array((rng.standard_normal(5) * 4).astype(dtype))
    return [good, bad]


@pytest.mark.parametrize("dtype", ["int32", "int16", "uint8", "bool"])
def test_an_integer_gradient_for_a_float_variable_is_refused_before_build(backend, rng, dtype):
    variables = make(backend, rng)
    before = snapshot(backend, variables)
    opt = Adam(learning_rate=0.1)
    with pytest.raises(ValueError, match=MESSAGE.format(dtype)):
        opt.apply(bad_grads(backend, rng, dtype), variables)
    assert not opt.built
    assert_unchanged(backend, before, variables)


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_an_integer_gradient_writes_nothing_after_a_step(backend, rng, dtype):
    variables = make(backend, rng)
    opt = ls.LossScaleOptimizer(Adam(learning_rate=0.1), initial_scale=8.0)
    opt.scale_loss(1.0)
    opt.apply([backend.array(rng.standard_normal(v.shape)) for v in variables], variables)
    state = variables + opt.variables
    before = snapshot(backend, state)
    with pytest.raises(ValueError, match=MESSAGE.format(dtype)):
        opt.apply(bad_grads(backend, rng, dtype), variables)
    assert_unchanged(backend, before, state)
    assert int(backend.numpy(opt.iterations)) == 1


def test_stateless_apply_refuses_an_integer_gradient(backend, rng):
    variables = make(backend, rng)
    opt = SGD(learning_rate=0.1, momentum=0.9)
    opt.build(variables)
    own = [v.value for v in opt.variables]
    with pytest.raises(ValueError, match=MESSAGE.format("int32")):
        opt.stateless_apply(own, bad_grads(backend, rng, "int32"), [v.value for v in variables])


def test_float_gradients_of_another_width_still_apply(backend, rng):
    # The rule is about kind: a float16 gradient for a float32 variable is cast, as before.
    variables = make(backend, rng)
    grads = [backend.array(rng.standard_normal(v.shape), dtype="float16") for v in variables]
    before = snapshot(backend, variables)
    SGD(learning_rate=0.5).apply(grads, variables)
    for b, g, v in zip(before, grads, variables):
        expected = b - np.float32(0.5) * backend.numpy(g).astype(np.float32)
        np.testing.assert_allclose(backend.numpy(v), expected, rtol=1e-6)


# --- sparse gradients (TensorFlow's tf.IndexedSlices) ---------------------------
VOCABULARY, WIDTH = 50_000, 64


def _embedding_steps(mode, dense, bad_at=None):
    """Three Adam steps of an embedding table under a LossScaleOptimizer, from a tape.

    `dense`: pass `tf.convert_to_tensor` of each gradient instead of the
    `tf.IndexedSlices` the tape gives. `bad_at`: (step, index into the
    looked-up rows' values) given inf there. Returns the table after each
    step and the scales.
    """
    import tensorflow as tf

    rng = np.random.default_rng(8)
    table = tf.Variable(rng.normal(size=(VOCABULARY, WIDTH)).astype(np.float32))
    head = tf.Variable(rng.normal(size=(WIDTH, 1)).astype(np.float32))
    opt = ls.LossScaleOptimizer(Adam(0.01), initial_scale=2.0**10)
    ids = rng.integers(0, VOCABULARY, size=(3, 512)).astype(np.int32)
    ids[:, :256] = rng.integers(0, 30, size=(3, 256))  # rows repeated within a step

    def step(ids, poison):
        with tf.GradientTape() as tape:
            rows = tf.nn.embedding_lookup(table, ids)
            loss = tf.reduce_mean(tf.matmul(rows, head) ** 2)
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, [table, head])
        assert isinstance(grads[0], tf.IndexedSlices)
        # One value of the sparse gradient made inf (the others + 0).
        grads[0] = tf.IndexedSlices(
            grads[0].values + poison, grads[0].indices, grads[0].dense_shape
        )
        if dense:
            grads = [tf.convert_to_tensor(g) for g in grads]
        opt.apply(grads, [table, head])

    run = step if mode == "eager" else tf.function(step, jit_compile=mode == "xla")
    tables, scales = [], []
    for k in range(3):
        poison = np.zeros((512, WIDTH), np.float32)
        if bad_at is not None and bad_at[0] == k:
            poison[bad_at[1]] = np.inf
        run(tf.constant(ids[k]), tf.constant(poison))
        tables.append(table.numpy().copy())
        scales.append(float(opt.dynamic_scale))
    return tables, scales


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_a_sparse_gradient_trains_as_its_dense_form(mode):
    sparse, sparse_scales = _embedding_steps(mode, dense=False)
    dense, dense_scales = _embedding_steps(mode, dense=True)
    assert sparse_scales == dense_scales
    for a, b in zip(sparse, dense):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(sparse[0], sparse[2])


@pytest.mark.parametrize("mode", ["eager", "xla"])
def test_a_bad_value_anywhere_in_a_sparse_gradient_skips_the_step(mode):
    clean, _ = _embedding_steps(mode, dense=False)
    rng = np.random.default_rng(9)
    for where in [(0, 0), (511, WIDTH - 1), tuple(rng.integers(0, [512, WIDTH]))]:
        tables, scales = _embedding_steps(mode, dense=False, bad_at=(1, where))
        np.testing.assert_array_equal(tables[1], clean[0])  # step 1 skipped
        assert scales[1] == scales[0] / 2
