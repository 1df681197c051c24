"""What the Adam family (Adam, Adamax, Nadam, Lamb) shares: rate checks, moments, averages."""

from lossscale import validation


def check_rates(beta_1, beta_2, epsilon):
    """Checks `beta_1` and `beta_2` in [0, 1) and `epsilon` > 0, in that order."""
    validation.check_number("beta_1", beta_1, low=0, high=1, high_open=True)
    validation.check_number("beta_2", beta_2, low=0, high=1, high_open=True)
    validation.check_number("epsilon", epsilon, low=0, low_open=True)


def add_moments(optimizer, var_list):
    """`(momentums, velocities)`: a 1st- and a 2nd-moment slot per variable."""
    return optimizer.add_optimizer_variables(var_list, ["momentum", "velocity"])


def powers_at_step(optimizer, dtype, *betas):
    """`beta**t` of `dtype` for each of `betas`, where `t = iterations + 1` (the step taken)."""
    ops = optimizer._ops
    step = ops.cast(optimizer.iterations + 1, dtype)
    return tuple(ops.power(ops.cast(beta, dtype), step) for beta in betas)


def update_average(optimizer, average, value, beta):
    """`average += (value - average) * (1 - beta)`, written through `optimizer`."""
    optimizer.assign_add(average, (value - average.value) * (1 - beta))


def update_moments(optimizer, m, v, gradient):
    """Moves `m` toward the gradient by `beta_1` and `v` toward its square by `beta_2`."""
    update_average(optimizer, m, gradient, optimizer.beta_1)
    update_average(optimizer, v, optimizer._ops.square(gradient), optimizer.beta_2)
