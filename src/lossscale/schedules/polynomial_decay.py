"""`PolynomialDecay`: a polynomial ramp from the initial to the end learning rate."""

from __future__ import annotations

from lossscale import validation
from lossscale.schedules import _common
from lossscale.schedules.base import LearningRateSchedule
from lossscale.typing import Array


class PolynomialDecay(LearningRateSchedule):
    """A `LearningRateSchedule` that uses a polynomial decay schedule.

    ```
    if cycle:
        horizon = decay_steps * max(1, ceil(step / decay_steps))
    else:
        horizon, step = decay_steps, min(step, decay_steps)
    learning_rate = ((initial_learning_rate - end_learning_rate)
                     * (1 - step / horizon)**power + end_learning_rate)
    ```

    Args:
        initial_learning_rate: Float >= 0. The initial learning rate.
        decay_steps: Number > 0. The decay horizon, in steps.
        end_learning_rate: Float >= 0. The minimal end learning rate.
            Defaults to `0.0001`.
        power: Float >= 0. The power of the polynomial. Defaults to `1.0`
            (linear).
        cycle: Boolean. Whether to cycle beyond `decay_steps`. Defaults to
            `False`.
        name: String. Defaults to `"PolynomialDecay"`.

    Examples:
        >>> import lossscale as ls
        >>> schedule = ls.schedules.PolynomialDecay(0.1, decay_steps=10, end_learning_rate=0.0)
        >>> round(float(schedule(5)), 6), float(schedule(50))
        (0.05, 0.0)
    """

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        end_learning_rate: float = 0.0001,
        power: float = 1.0,
        cycle: bool = False,
        name: str = "PolynomialDecay",
    ) -> None:
        validation.check_number("initial_learning_rate", initial_learning_rate, low=0)
        _common.check_decay_steps("decay_steps", decay_steps)
        validation.check_number("end_learning_rate", end_learning_rate, low=0)
        validation.check_number("power", power, low=0)
        validation.check_bool("cycle", cycle)
        _common.check_name(name)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.end_learning_rate = end_learning_rate
        self.power = power
        self.cycle = cycle
        self.name = name

    def __call__(self, step: Array) -> Array:
        ops, step = _common.float_step(step)
        if self.cycle:
            # ceil(x) == -floor(-x); step 0 counts as inside the first period.
            periods = -ops.floor(-step / self.decay_steps)
            horizon = self.decay_steps * ops.where(step == 0, 1.0, periods)
        else:
            step = ops.minimum(step, self.decay_steps)
            horizon = self.decay_steps
        p = step / horizon
        return (self.initial_learning_rate - self.end_learning_rate) * ops.power(
            1.0 - p, self.power
        ) + self.end_learning_rate

    get_config = _common.signature_config
