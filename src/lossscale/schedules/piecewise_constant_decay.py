"""`PiecewiseConstantDecay`: constant learning rates between step boundaries."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from lossscale.schedules import _common
from lossscale.schedules.base import LearningRateSchedule
from lossscale.typing import Array


class PiecewiseConstantDecay(LearningRateSchedule):
    """A `LearningRateSchedule` that uses a piecewise constant decay schedule.

    ```
    values[0]      if step <= boundaries[0]
    values[i]      if boundaries[i - 1] < step <= boundaries[i]
    values[-1]     if step > boundaries[-1]
    ```

    Args:
        boundaries: A non-empty list of strictly increasing numbers, the
            steps at which the value changes.
        values: A list of numbers, one more than `boundaries`: the value
            for each interval.
        name: String. Defaults to `"PiecewiseConstant"`.

    Examples:
        >>> import lossscale as ls
        >>> schedule = ls.schedules.PiecewiseConstantDecay([100, 110], [1.0, 0.5, 0.1])
        >>> [round(float(schedule(s)), 6) for s in (100, 101, 111)]
        [1.0, 0.5, 0.1]
    """

    def __init__(
        self,
        boundaries: Sequence[float],
        values: Sequence[float],
        name: str = "PiecewiseConstant",
    ) -> None:
        boundaries, values = _number_list("boundaries", boundaries), _number_list("values", values)
        if not boundaries or any(b >= c for b, c in zip(boundaries, boundaries[1:])):
            raise ValueError(
                "`boundaries` must be a non-empty list of strictly increasing numbers. "
                f"Received: boundaries={boundaries}"
            )
        if len(boundaries) != len(values) - 1:
            raise ValueError(
                "The length of `boundaries` should be 1 less than the length of `values`. "
                f"Received: boundaries={boundaries} of length {len(boundaries)}, and "
                f"values={values} of length {len(values)}."
            )
        _common.check_name(name)
        self.boundaries = boundaries
        self.values = values
        self.name = name

    def __call__(self, step: Array) -> Array:
        ops, _ = _common.float_step(step)
        # Compared in the step's own dtype, like Keras's cast.
        step = ops.asarray(step)
        bounds, values = self.boundaries, self.values
        if ops.dtype_name(step).startswith(("int", "uint")):
            # TensorFlow compares an integer tensor with integers only.
            bounds = [math.floor(b) for b in bounds]

        def mask(condition):
            return ops.cast(condition, _common.DTYPE)

        result = mask(step <= bounds[0]) * values[0] + mask(step > bounds[-1]) * values[-1]
        for low, high, value in zip(bounds[:-1], bounds[1:], values[1:-1]):
            result = result + mask(ops.logical_and(step > low, step <= high)) * value
        return result

    get_config = _common.signature_config


def _number_list(name, received):
    """`received` as a list of plain numbers (JSON-friendly config), or a clear error."""
    xs = list(received) if isinstance(received, (list, tuple)) else None
    if xs is None or not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in xs):
        raise ValueError(f"`{name}` must be a list of numbers. Received: {name}={received!r}")
    return [x.item() if isinstance(x, np.generic) else x for x in xs]
