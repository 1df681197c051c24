"""`ExponentialDecay`: the learning rate shrinks by a constant factor per period."""

from __future__ import annotations

from lossscale import validation
from lossscale.schedules import _common
from lossscale.schedules.base import LearningRateSchedule
from lossscale.typing import Array


class ExponentialDecay(LearningRateSchedule):
    """A `LearningRateSchedule` that uses an exponential decay schedule.

    ```
    p = step / decay_steps                    # floor(step / decay_steps) if staircase
    learning_rate = initial_learning_rate * decay_rate**p
    ```

    Args:
        initial_learning_rate: Float >= 0. The initial learning rate.
        decay_steps: Number > 0. The decay period, in steps.
        decay_rate: Float >= 0. The decay rate per period.
        staircase: Boolean. If `True`, decay the learning rate at discrete
            intervals (an integer number of periods). Defaults to `False`.
        name: String. Defaults to `"ExponentialDecay"`.

    Examples:
        >>> import lossscale as ls
        >>> schedule = ls.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
        >>> round(float(schedule(20)), 6)
        0.025
        >>> opt = ls.optimizers.SGD(learning_rate=schedule)
    """

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        decay_rate: float,
        staircase: bool = False,
        name: str = "ExponentialDecay",
    ) -> None:
        validation.check_number("initial_learning_rate", initial_learning_rate, low=0)
        _common.check_decay_steps("decay_steps", decay_steps)
        validation.check_number("decay_rate", decay_rate, low=0)
        validation.check_bool("staircase", staircase)
        _common.check_name(name)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = name

    def __call__(self, step: Array) -> Array:
        ops, step = _common.float_step(step)
        p = step / self.decay_steps
        if self.staircase:
            p = ops.floor(p)
        return self.initial_learning_rate * ops.power(self.decay_rate, p)

    get_config = _common.signature_config
