"""Exponential moving average of model variables."""


def update_moving_averages(ops, averages, variables, momentum, is_first_step):
    """`average = m * average + (1 - m) * variable`, `m = 0` on the first step; skips `None`."""
    for variable, average in zip(variables, averages):
        if average is None:
            continue
        m = ops.cast(ops.logical_not(is_first_step), variable.dtype) * momentum
        average.assign(m * average.value + (1 - m) * variable.value)


def overwrite_with_averages(variables, averages):
    """Assigns each moving average to its model variable."""
    if len(variables) != len(averages):
        raise ValueError(
            f"The length of model variables ({len(variables)}) to override does not match "
            f"the length of model variables stored in the optimizer ({len(averages)}). "
            "Please check that the optimizer was built on these variables."
        )
    for variable, average in zip(variables, averages):
        if average is not None:
            variable.assign(average.value)
