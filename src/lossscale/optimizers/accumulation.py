"""Gradient accumulation: update every `steps` calls with the mean gradient.

As in Keras 3, an update step resets every accumulator, also that of a
variable whose gradient is `None` at that step. Skipped steps (a
`LossScaleOptimizer` overflow) do not count: not even the window moves.
"""


def is_update_step(raw_iterations, steps):
    """True on the call that completes a group of `steps` micro-steps."""
    return (raw_iterations + 1) % steps == 0


def mean_with_accumulated(grads, accumulators, steps):
    """The mean of the accumulated gradients and this step's."""
    return [(g + acc.value) / steps for g, acc in zip(grads, accumulators)]


def accumulate(grads, accumulators):
    """Adds this step's gradients to the accumulators."""
    for g, acc in zip(grads, accumulators):
        acc.assign_add(g)


def reset(ops, accumulators):
    """Zeroes the accumulators."""
    for acc in accumulators:
        acc.assign(_zeros(ops, acc))


def overwrite_with_max(ops, variable, grad, accumulator, update):
    """Overwrite-with-gradient variables keep the running maximum; they take it on update."""
    running = ops.maximum(grad, accumulator.value)
    variable.assign(ops.where(update, running, variable.value))
    accumulator.assign(ops.where(update, _zeros(ops, accumulator), running))


def _zeros(ops, variable):
    return ops.full(variable.shape, 0, variable.dtype, like=variable.value)
