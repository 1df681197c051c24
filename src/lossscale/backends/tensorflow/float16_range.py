"""The float16 range of gradients on TensorFlow, in working memory that does not grow with them.

`mixed_precision.diagnostics.measure` reduces a whole gradient at once.
Compiled by XLA (`tf.function(jit_compile=True)`, Keras's default on
TensorFlow), XLA's CPU backend does not fuse a whole-tensor integer sum
with the comparison feeding it: each of the measurement's four
comparisons was written out as an int32 array the size of the gradient,
and XLA reserves a branch's working memory on every step, taken or not.
`measure` here gives the same four numbers per gradient, bit for bit,
reading a gradient of more than `CHUNK` elements one chunk at a time in a
`tf.while_loop`:

```
x = float32(grad), flattened          # a view: no copy
for each chunk of CHUNK elements (and the elements after the last whole one):
    a = |chunk|
    counts += sum(a == 0), sum(a < 2^-14), sum(a >= near), sum(a <= inf)
    peak = max(peak, max(a))
zero, subnormal, near_max = counts / size   # exact counts, one division
max_abs = peak, NaN unless every element is a number (NaN compares False)
```

Counts are exact whatever order they are summed in, and a largest value
is the same whatever order it is taken in, so the result is `measure`'s.
A gradient of at most `CHUNK` elements is measured whole, as `measure`
does: the measurement's working memory stays under about `20 * CHUNK`
bytes (the four comparisons as int32 and a float32 magnitude) whatever
the model.
"""

import tensorflow as tf

from lossscale.backends.tensorflow import ops

# Elements read at a time from a larger gradient: the measurement's working
# memory is a few arrays of this size (about 20 MiB at most). `gpt`'s
# gradients are all smaller, so its program has no loop.
CHUNK = 1 << 20


def measure(grads, subnormal_below, near_from):
    """The float16 range of each of `grads`, as four vectors.

    Args:
        grads: Floating-point tensors (a sparse `tf.IndexedSlices` is made
            dense first, as `measure` makes it), each with at least one
            element.
        subnormal_below: Magnitudes under it (and above 0) count as subnormal.
        near_from: Magnitudes from it on (inf included) count as near the
            maximum.

    Returns:
        `(zero, subnormal, near_max, max_abs)`, float32 vectors whose entry
        i is `grads[i]`'s; None for no gradients.
    """
    if not grads:
        return None
    edges = (tf.constant(subnormal_below, tf.float32), tf.constant(near_from, tf.float32))
    rows = [_measured(_dense(g), edges) for g in grads]
    return tuple(tf.stack(list(column)) for column in zip(*rows))


def _dense(grad):
    """`grad` as a tensor of its static shape.

    A sparse gradient made dense inside a traced function loses its
    static shape (its row count becomes a tensor): it is given back.
    """
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
