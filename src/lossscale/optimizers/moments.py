"""What the Adam family shares: rate checks, moment slots, moving averages.

Adam, Adamax, Nadam and Lamb all keep exponential moving averages of the
gradient (and of its square) started at zero, and correct their bias with
`beta**t`. Those pieces are written here once; each optimizer's own module
keeps its update rule, built from them.
"""

from lossscale import validation


def check_rates(beta_1, beta_2, epsilon):
    """Checks the two decay rates and the epsilon of an Adam-style optimizer.

    Args:
        beta_1: Decay rate of the 1st moment; accepted in [0, 1).
        beta_2: Decay rate of the 2nd moment; accepted in [0, 1).
        epsilon: Constant for numerical stability; accepted > 0.

    Raises:
        ValueError: For the first argument out of range, in the order
            above, e.g. "`beta_1` must be a finite number >= 0 and < 1.
            Received: beta_1=1.5".
    """
    validation.check_number("beta_1", beta_1, low=0, high=1, high_open=True)
    validation.check_number("beta_2", beta_2, low=0, high=1, high_open=True)
    validation.check_number("epsilon", epsilon, low=0, low_open=True)


def add_moments(optimizer, var_list):
    """Adds a `momentum` (1st moment) and a `velocity` (2nd moment) slot per variable.

    Args:
        optimizer: The optimizer being built.
        var_list: Its trainable variables.

    Returns:
        The tuple `(momentums, velocities)`, one list of slots each, in the
        order of `var_list` (`None` for overwrite-with-gradient variables).
    """
    return optimizer.add_optimizer_variables(var_list, ["momentum", "velocity"])


def powers_at_step(optimizer, dtype, *betas):
    """Returns `beta**t` for each of `betas`, where `t = iterations + 1`.

    `t` counts the step being taken, so on the first step the powers are the
    betas themselves; `1 - beta**t` is then the bias of an average started
    at zero.

    Args:
        optimizer: The optimizer taking the step (its `iterations` and ops).
        dtype: Dtype of the result (the variable's).
        *betas: Python numbers.

    Returns:
        A tuple of scalars of `dtype`, one per beta.
    """
    ops = optimizer._ops
    step = ops.cast(optimizer.iterations + 1, dtype)
    return tuple(ops.power(ops.cast(beta, dtype), step) for beta in betas)


def update_average(optimizer, average, value, beta):
    """Moves a moving average toward `value`: `average += (value - average) * (1 - beta)`.

    Args:
        optimizer: The optimizer whose `assign_add` writes the slot.
        average: The slot `Variable`.
        value: The new observation, of the slot's dtype.
        beta: The decay rate, a Python number.
    """
    optimizer.assign_add(average, (value - average.value) * (1 - beta))


def update_moments(optimizer, m, v, gradient):
    """Moves the 1st and 2nd moments of one variable toward its new gradient.

    ```
    m = m + (g - m) * (1 - beta_1)
    v = v + (g**2 - v) * (1 - beta_2)
    ```

    Args:
        optimizer: The optimizer (its `beta_1`, `beta_2` and ops).
        m: The variable's `momentum` slot.
        v: The variable's `velocity` slot.
        gradient: The gradient, of the slots' dtype.
    """
    update_average(optimizer, m, gradient, optimizer.beta_1)
    update_average(optimizer, v, optimizer._ops.square(gradient), optimizer.beta_2)
