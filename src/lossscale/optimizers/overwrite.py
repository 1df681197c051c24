"""Overwrite-with-gradient variables: they take their gradient as their value.

Such variables (float8 scaling factors, for instance) are not trained: the
"gradient" is their next value. With gradient accumulation they keep the
running maximum and take it on update steps.
"""

from lossscale.optimizers import accumulation


def take_gradients(optimizer, ops, grads, variables):
    """Assigns each overwrite-with-gradient variable; returns the other pairs.

    Args:
        optimizer: The optimizer applying the step (for its accumulators).
        ops: The backend module.
        grads, variables: The step's gradients and variables.

    Returns:
        `(grads, variables)` without the overwritten ones.
    """
    if not any(v.overwrite_with_gradient for v in variables):
        return grads, variables
    steps = optimizer.gradient_accumulation_steps
    kept = []
    for g, v in zip(grads, variables):
        if not v.overwrite_with_gradient:
            kept.append((g, v))
        elif g is None:
            continue
        elif steps:
            acc = optimizer._accumulated_gradients[optimizer._get_variable_index(v)]
            update = accumulation.is_update_step(optimizer._iterations.value, steps)
            accumulation.overwrite_with_max(ops, v, g, acc, update)
        else:
            v.assign(ops.cast(g, v.dtype))
    return [g for g, _ in kept], [v for _, v in kept]
