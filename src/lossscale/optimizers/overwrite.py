"""Overwrite-with-gradient variables (float8 scaling factors, say): the gradient is the value."""

from lossscale.optimizers import accumulation as accumulation_rules


def take_gradients(ops, grads, variables, accumulation=None):
    """Assigns each overwrite-with-gradient variable; returns the other `(grads, variables)`.

    `accumulation`: None, or `(accumulator_of, is_update)` under gradient accumulation.
    """
    if not any(v.overwrite_with_gradient for v in variables):
        return grads, variables
    kept = []
    for g, v in zip(grads, variables):
        if not v.overwrite_with_gradient:
            kept.append((g, v))
        elif g is None:
            continue
        elif accumulation is not None:
            accumulator_of, is_update = accumulation
            accumulation_rules.overwrite_with_max(ops, v, g, accumulator_of(v), is_update())
        else:
            v.assign(ops.cast(g, v.dtype))
    return [g for g, _ in kept], [v for _, v in kept]
