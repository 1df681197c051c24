"""Gradient clipping: pure functions of a gradient list."""

# The smallest normal float32.
_TINY = 2.0**-126


def clip_by_norm(ops, grad, clipnorm):
    """Rescales `grad` so its L2 norm is at most `clipnorm`."""
    l2sum = ops.sum(ops.square(grad))
    # sqrt of a positive argument only: the derivative under JAX stays finite.
    positive = l2sum > 0
    norm = ops.where(positive, ops.sqrt(ops.where(positive, l2sum, 1.0)), l2sum)
    return grad * clipnorm / ops.maximum(norm, clipnorm)


def clip_by_global_norm(ops, grads, clipnorm):
    """Rescales all `grads` together so their global L2 norm is at most `clipnorm`."""
    norm = ops.global_norm(grads)
    # The floor keeps an all-zero gradient from dividing by zero, changing no result.
    factor = clipnorm * ops.minimum(1.0 / ops.maximum(norm, _TINY), 1.0 / clipnorm)
    # A non-finite gradient poisons the result, not scaled to zero (selected: no warning).
    factor = factor + ops.where(ops.isfinite(norm), 0.0, float("nan"))
    return [g * ops.cast(factor, ops.dtype_name(g)) for g in grads]


def clip_gradients(ops, grads, clipnorm=None, clipvalue=None, global_clipnorm=None):
    """Applies whichever clipping option is set; returns a new list."""
    if clipnorm is not None:
        return [clip_by_norm(ops, g, clipnorm) for g in grads]
    if global_clipnorm is not None:
        return clip_by_global_norm(ops, grads, global_clipnorm)
    if clipvalue is not None:
        return [ops.clip(g, -clipvalue, clipvalue) for g in grads]
    return list(grads)
