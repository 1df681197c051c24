"""Unscale, finite check and norms over lists of tensors.

XLA's CPU max-reduction drops NaN, so the finite check reduces `is_finite`
and `max_abs` tests for NaN explicitly.
"""

import tensorflow as tf

from lossscale.backends.tensorflow import ops


def _tensors(arrays):
    return [ops._tensor(a) for a in arrays]


def sparse_or_tensors(arrays):
    """`_tensors(arrays)`, sparse gradients (`tf.IndexedSlices`) kept as they are."""
    return [a if isinstance(a, tf.IndexedSlices) else ops._tensor(a) for a in arrays]


def unscale(grads, scale, in_place=False):
    scale = ops._tensor(scale)
    divisors = {}  # the scale cast once per gradient dtype
    out = []
    for g in sparse_or_tensors(grads):
        # A sparse gradient stays sparse, as Keras's `divide` keeps it.
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        if values.dtype.size < 4:
            values = tf.cast(values, tf.float32)
        divisor = divisors.get(values.dtype)
        if divisor is None:
            divisor = divisors[values.dtype] = tf.cast(scale, values.dtype)
        values = values / divisor
        out.append(
            tf.IndexedSlices(values, g.indices, g.dense_shape)
            if isinstance(g, tf.IndexedSlices)
            else values
        )
    return out


def all_finite(arrays):
    flags = [tf.reduce_all(tf.math.is_finite(a)) for a in _tensors(arrays)]
    if not flags:
        return tf.constant(True)
    return flags[0] if len(flags) == 1 else tf.reduce_all(tf.stack(flags))


def finite_flags(arrays):
    finite = all_finite(arrays)
    return finite, tf.cast(tf.logical_not(finite), tf.float32)


def global_norm(arrays):
    squares = [
        tf.reduce_sum(tf.square(tf.cast(a, tf.float32) if a.dtype.size < 4 else a))
        for a in _tensors(arrays)
    ]
    if not squares:
        return tf.constant(0.0)
    return tf.sqrt(tf.add_n(squares) if len(squares) > 1 else squares[0])


def finite_unscaled(arrays, scale):
    """Whether every element of `arrays`, divided by `scale`, is finite (by the peak)."""
    return tf.math.is_finite(max_abs(arrays) / tf.cast(scale, tf.float32))


def max_abs(arrays):
    """Largest |x| over all arrays as a float32 scalar (NaN if any NaN)."""
    arrays = _tensors(arrays)
    if not arrays:
        return tf.constant(0.0)
    peaks = tf.stack([tf.cast(tf.reduce_max(tf.abs(a)), tf.float32) for a in arrays])
    nan = tf.reduce_any(tf.stack([tf.reduce_any(tf.math.is_nan(a)) for a in arrays]))
    return tf.where(nan, tf.constant(float("nan")), tf.reduce_max(peaks))
