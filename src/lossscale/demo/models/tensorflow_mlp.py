"""The demo network in TensorFlow, differentiated by `tf.GradientTape` in a `tf.function`."""

import contextlib

import numpy as np
import tensorflow as tf
from threadpoolctl import threadpool_limits

from lossscale.demo.models import check_precision, wrap


def _logits(params, x):
    w1, b1, w2, b2 = params
    return tf.nn.relu(x @ w1 + b1) @ w2 + b2


def _cross_entropy(logits, y):
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.cast(logits, tf.float32)
    )
    return tf.reduce_mean(losses)


@tf.function(reduce_retracing=True)
def _gradients(params, x, y, factor, dtype_is_half):
    # Differentiating with respect to the cast copies gives gradients in
    # the pass's own precision, as the torch and NumPy models do.
    dtype = tf.float16 if dtype_is_half else tf.float32
    working = [tf.cast(p, dtype) for p in params]
    with tf.GradientTape() as tape:
        tape.watch(working)
        loss = _cross_entropy(_logits(working, tf.cast(x, dtype)), y)
        weighted = loss * factor
    return loss, tape.gradient(weighted, working)


@tf.function(reduce_retracing=True)
def _evaluate(params, x, y):
    logits = _logits(params, x)
    hits = tf.cast(tf.argmax(logits, axis=1, output_type=tf.int64) == y, tf.float32)
    return _cross_entropy(logits, y), tf.reduce_mean(hits)


@contextlib.contextmanager
def single_threaded():
    # TensorFlow sizes its own thread pools when it first runs an op and
    # cannot resize them afterwards: the demo asks for one thread when it
    # is the first to run TensorFlow in the process, and otherwise runs on
    # the pools as they are.
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass
    with threadpool_limits(limits=1):
        yield


class MLP:
    """Float32 master `tf.Variable`s; the float16 pass works on cast copies."""

    backend = "tensorflow"

    def __init__(self, weights):
        names = ("w1", "b1", "w2", "b2")
        self.variables = wrap(
            [tf.Variable(np.asarray(w, np.float32), name=n) for w, n in zip(weights, names)]
        )

    def gradients(self, x, y, precision, loss_weight, scale_loss):
        check_precision(precision)
        # scale_loss is linear, so its derivative is its value at 1; passing
        # it as a tensor argument keeps one traced function for every scale.
        factor = tf.cast(loss_weight, tf.float32) * tf.cast(scale_loss(1.0), tf.float32)
        loss, grads = _gradients(
            [v.value for v in self.variables],
            tf.constant(x),
            tf.constant(y, tf.int64),
            factor,
            precision == "float16",
        )
        return loss, list(grads)

    def evaluate(self, x, y):
        loss, accuracy = _evaluate(
            [v.value for v in self.variables], tf.constant(x), tf.constant(y, tf.int64)
        )
        return float(loss), float(accuracy)
