"""The demo network in JAX, differentiated by `jax.grad` under `jax.jit`."""

import functools

import jax
import jax.numpy as jnp
from threadpoolctl import threadpool_limits

from lossscale.demo.models import check_precision, wrap


def _logits(params, x):
    w1, b1, w2, b2 = params
    return jax.nn.relu(x @ w1 + b1) @ w2 + b2


def _cross_entropy(logits, y):
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(log_probs, y[:, None], axis=1).mean()


def _weighted_loss(params, x, y, factor):
    loss = _cross_entropy(_logits(params, x.astype(params[0].dtype)), y)
    return loss * factor, loss


@functools.partial(jax.jit, static_argnames="dtype")
def _gradients(params, x, y, factor, dtype):
    # Differentiating with respect to the cast copies gives gradients in
    # the pass's own precision, as the torch and NumPy models do.
    working = [p.astype(dtype) for p in params]
    grads, loss = jax.grad(_weighted_loss, has_aux=True)(working, x, y, factor)
    return loss, grads


@jax.jit
def _evaluate(params, x, y):
    logits = _logits(params, x)
    return _cross_entropy(logits, y), (logits.argmax(axis=1) == y).mean()


def single_threaded():
    # XLA sizes its own thread pool when it starts; only BLAS pools can be
    # limited afterwards.
    return threadpool_limits(limits=1)


class MLP:
    """Float32 master variables; the float16 pass works on cast copies."""

    backend = "jax"

    def __init__(self, weights):
        self.variables = wrap([jnp.asarray(w, dtype=jnp.float32) for w in weights])

    def gradients(self, x, y, precision, loss_weight, scale_loss):
        check_precision(precision)
        # scale_loss is linear, so its derivative is its value at 1; passing
        # it as an argument keeps one compiled function for every scale.
        factor = jnp.float32(loss_weight) * jnp.asarray(scale_loss(1.0), jnp.float32)
        return _gradients(
            [v.value for v in self.variables],
            jnp.asarray(x),
            jnp.asarray(y),
            factor,
            jnp.dtype(precision),
        )

    def evaluate(self, x, y):
        loss, accuracy = _evaluate(
            [v.value for v in self.variables], jnp.asarray(x), jnp.asarray(y)
        )
        return float(loss), float(accuracy)
