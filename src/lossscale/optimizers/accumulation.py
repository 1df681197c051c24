"""Gradient accumulation: update every `steps` calls with the mean gradient.

As in Keras 3, an update step resets every accumulator, also that of a
variable whose gradient is `None` at that step: its window ends with the
others, and its partial sum is dropped. Skipped steps (a `LossScaleOptimizer`
overflow) do not count: nothing moves, not even the window.
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
        acc.assign(ops.full(acc.shape, 0, acc.dtype, like=acc.value))


def overwrite_with_max(ops, variable, grad, accumulator, update):
    """Accumulation rule for overwrite-with-gradient variables.

    Such variables (float8 scaling factors, for instance) keep the running
    maximum of their "gradients" and take it on update steps.
    """
    running = ops.maximum(grad, accumulator.value)
    variable.assign(ops.where(update, running, variable.value))
    accumulator.assign(
        ops.where(
            update,
            ops.full(accumulator.shape, 0, accumulator.dtype, like=accumulator.value),
            running,
        )
    )
