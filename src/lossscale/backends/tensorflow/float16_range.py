"""The float16 range of gradients on TensorFlow, in working memory that does not grow with them.

Under XLA, `diagnostics.measure` writes each comparison out as an int32
array the size of the gradient, reserved on every step. This gives the
same four numbers, bit for bit (counts and peaks do not depend on order),
reading a gradient of more than `CHUNK` elements one chunk at a time in a
`tf.while_loop`: the working memory stays under about `20 * CHUNK` bytes.
"""

import tensorflow as tf

from lossscale.backends.tensorflow import ops

CHUNK = 1 << 20


def measure(grads, subnormal_below, near_from):
    """The backend's `fused_float16_range` kernel (see the protocol); None for no gradients."""
    if not grads:
        return None
    edges = (tf.constant(subnormal_below, tf.float32), tf.constant(near_from, tf.float32))
    rows = [_measured(_dense(g), edges) for g in grads]
    return tuple(tf.stack(list(column)) for column in zip(*rows))


def _dense(grad):
    """`grad` as a tensor of its static shape (lost by a sparse one made dense when traced)."""
    dense = ops._tensor(grad)
    if not dense.shape.is_fully_defined():
        dense = tf.ensure_shape(dense, grad.shape)
    return dense


def _measured(grad, edges):
    """`(zero, subnormal, near_max, max_abs)` of one gradient, float32 scalars."""
    size = grad.shape.num_elements()
    if size <= CHUNK:
        counts, peak = _counted(grad, edges)
    else:
        counts, peak = _counted_in_chunks(tf.reshape(grad, [-1]), size, edges)
    zero, below, near, numbers = tf.unstack(counts)
    shares = [tf.cast(c, tf.float32) / float(size) for c in (zero, below - zero, near)]
    return (*shares, tf.where(numbers == size, peak, float("nan")))


def _counted(x, edges):
    """The counts `(zero, below normal, near the maximum, numbers)` of `x` (int32) and its peak."""
    subnormal_below, near_from = edges
    a = tf.abs(tf.cast(x, tf.float32))
    tests = (a == 0, a < subnormal_below, a >= near_from, a <= float("inf"))
    counts = tf.stack([tf.reduce_sum(tf.cast(t, tf.int32)) for t in tests])
    return counts, tf.reduce_max(a)


def _counted_in_chunks(flat, size, edges):
    """`_counted` of the vector `flat` (`size` elements), read `CHUNK` elements at a time."""
    whole, rest = divmod(size, CHUNK)
    index_dtype = tf.int32 if size < 2**31 else tf.int64

    def body(i, counts, peak):
        start = tf.reshape(tf.cast(i, index_dtype) * CHUNK, [1])
        chunk_counts, chunk_peak = _counted(tf.slice(flat, start, [CHUNK]), edges)
        return i + 1, counts + chunk_counts, tf.maximum(peak, chunk_peak)

    start = (tf.constant(0), tf.zeros([4], tf.int32), tf.constant(0.0))
    _, counts, peak = tf.while_loop(lambda i, *_: i < whole, body, start)
    if rest:
        rest_counts, rest_peak = _counted(flat[whole * CHUNK :], edges)
        counts, peak = counts + rest_counts, tf.maximum(peak, rest_peak)
    return counts, peak
