"""keras/gates.py: how each Keras backend skips the inner step without a host read.

`run_stateful` (torch: the step runs, each variable is selected back where
`take` is False; TensorFlow: `tf.cond`, eagerly and in a `tf.function`) and
`run_stateless` (JAX `lax.cond`, TensorFlow `tf.cond`, torch selects),
with `take` True and False, against what the step itself writes; the
refusal of a backend it has no gate for.
"""

import os

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from lossscale.keras import gates  # noqa: E402
from tests.torch_cases import no_host_reads  # noqa: E402

RNG = np.random.default_rng(5)
VALUES = [RNG.standard_normal(s).astype("float32") for s in [(4, 3), (3,)]]
GRADS = [RNG.standard_normal(s).astype("float32") for s in [(4, 3), (3,)]]


@pytest.mark.parametrize("take", [False, True])
def test_torch_keeps_the_step_s_writes_only_where_take_holds(take):
    variables = [keras.Variable(v.copy()) for v in VALUES]
    untouched = keras.Variable(np.ones(2, "float32"))

    def step(grads):
        with torch.no_grad():  # in place, as Keras's torch optimizers write
            for v, g in zip(variables, grads):
                v.value.sub_(g * 0.5)

    grads = [torch.from_numpy(g) for g in GRADS]
    with no_host_reads():
        gates.run_stateful("torch", torch.tensor(take), step, grads, variables + [untouched])
    for v, x, g in zip(variables, VALUES, GRADS):
        expected = x - g * np.float32(0.5) if take else x
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), expected)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(untouched), [1.0, 1.0])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("take", [False, True])
def test_tensorflow_runs_the_step_under_tf_cond(take, compiled):
    import tensorflow as tf

    variables = [tf.Variable(v) for v in VALUES]

    def step(grads):
        for v, g in zip(variables, grads):
            v.assign_sub(g * 0.5)

    def run(take, grads):
        gates.run_stateful("tensorflow", take, step, grads, variables)

    if compiled:
        run = tf.function(run)
    run(tf.constant(take), [tf.constant(g) for g in GRADS])
    for v, x, g in zip(variables, VALUES, GRADS):
        np.testing.assert_array_equal(v.numpy(), x - g * np.float32(0.5) if take else x)


def _stateless_case(backend):
    if backend == "jax":
        import jax.numpy as xp

        return xp.asarray, lambda x: np.asarray(x)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.constant, lambda x: x.numpy()
    return (lambda x: torch.from_numpy(np.array(x))), lambda x: x.numpy()


@pytest.mark.parametrize("backend", ["jax", "tensorflow", "torch"])
@pytest.mark.parametrize("take", [False, True])
def test_run_stateless_returns_applied_or_skipped_values(backend, take):
    native, to_numpy = _stateless_case(backend)
    old = ([native(v) for v in VALUES] + [None], [native(np.float32(3.0))])

    def applied():
        # Keras's torch optimizers update the given values in place.
        model = [
            v.__isub__(native(g)) if backend == "torch" else v - native(g)
            for v, g in zip(old[0][:2], GRADS)
        ]
        return model + [None], [old[1][0] + native(np.float32(1.0))]

    new = gates.run_stateless(backend, native(np.array(take)), applied, lambda: old)
    model, optimizer = new
    assert model[2] is None and len(model) == 3
    for got, x, g in zip(model, VALUES, GRADS):
        np.testing.assert_array_equal(to_numpy(got), x - g if take else x)
    assert float(to_numpy(optimizer[0])) == (4.0 if take else 3.0)


def test_a_backend_without_a_gate_is_refused():
    with pytest.raises(
        ValueError, match=r"^`backend` must be 'tensorflow' or 'torch'. Received: backend='jax'$"
    ):
        gates.run_stateful("jax", True, lambda grads: None, [], [])
    with pytest.raises(
        ValueError,
        match=r"^`backend` must be 'jax', 'tensorflow' or 'torch'. Received: backend='numpy'$",
    ):
        gates.run_stateless("numpy", True, lambda: (), lambda: ())
