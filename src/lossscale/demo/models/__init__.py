"""One small network per array library: 64 pixels -> ReLU hidden layer -> 10 logits.

Every model holds its float32 master weights as `lossscale.Variable`s,
`variables` (named `w1`, `b1`, `w2`, `b2`): the optimizer updates them, in
place on torch, NumPy and TensorFlow (`tf.Variable`s) and by rebinding on
JAX, and the model reads them at every pass. It offers:

- `gradients(x, y, precision, loss_weight, scale_loss)`: the minibatch
  cross-entropy (a float32 backend scalar, unweighted) and the gradients of
  `scale_loss(loss_weight * cross_entropy)` with respect to the weights.
  With `precision="float32"` everything runs in float32. With
  `precision="float16"` the forward and backward passes run on a float16
  copy of the weights, so activations and gradients are float16 and the
  gradients come back as float16; the softmax cross-entropy itself is
  computed in float32 from the float16 logits, as autocast does. The
  gradient of the loss becomes float16 where it enters the logits: that is
  where small values flush to zero.
- `evaluate(x, y)`: `(cross_entropy, accuracy)` as Python floats, in float32.
"""

import importlib

from lossscale import validation
from lossscale.variables import Variable

BACKENDS = ("torch", "numpy", "jax", "tensorflow")
PRECISIONS = ("float32", "float16")
WEIGHT_NAMES = ("w1", "b1", "w2", "b2")


def make_model(backend, weights):
    """Returns the `MLP` of `backend` (`"torch"`, `"numpy"`, `"jax"`, `"tensorflow"`) of `weights`.

    Args:
        backend: The array library.
        weights: `[w1, b1, w2, b2]` float32 NumPy arrays (see
            `lossscale.demo.data.initial_weights`).
    """
    validation.check_choice("backend", backend, BACKENDS)
    module = importlib.import_module(f"lossscale.demo.models.{backend}_mlp")
    return module.MLP(weights)


def single_threaded(backend):
    """A context manager running `backend`'s work on one CPU thread, restored on exit.

    The demo's matrices are tiny (128 x 64 x 128): handing them to worker
    threads costs more than it saves, and on a busy machine spinning
    workers slow every step tenfold. Covers the BLAS and OpenMP pools every
    backend uses (through threadpoolctl, which scikit-learn installs) and
    torch's own intra-op pool.
    """
    validation.check_choice("backend", backend, BACKENDS)
    module = importlib.import_module(f"lossscale.demo.models.{backend}_mlp")
    return module.single_threaded()


def wrap(arrays):
    """Wraps native arrays as `lossscale.Variable`s named w1, b1, w2, b2 (no copy)."""
    return [Variable(a, name=n) for a, n in zip(arrays, WEIGHT_NAMES)]


def check_precision(precision):
    """Raises `ValueError` unless `precision` is `"float32"` or `"float16"`."""
    validation.check_choice("precision", precision, PRECISIONS)
