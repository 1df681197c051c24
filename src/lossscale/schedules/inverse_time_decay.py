"""`InverseTimeDecay`: the learning rate falls as one over (1 + rate * time)."""

from __future__ import annotations

from lossscale import validation
from lossscale.schedules import _common
from lossscale.schedules.base import LearningRateSchedule
from lossscale.typing import Array


class InverseTimeDecay(LearningRateSchedule):
    """A `LearningRateSchedule` that uses an inverse time decay schedule.

    ```
    p = step / decay_steps                    # floor(step / decay_steps) if staircase
    learning_rate = initial_learning_rate / (1 + decay_rate * p)
    ```

    Args:
        initial_learning_rate: Float >= 0. The initial learning rate.
        decay_steps: Number > 0. How often to apply the decay, in steps.
        decay_rate: Float >= 0. The decay rate.
        staircase: Boolean. Whether to apply the decay in a discrete
            staircase rather than continuously. Defaults to `False`.
        name: String. Defaults to `"InverseTimeDecay"`.

    Examples:
        >>> import lossscale as ls
        >>> schedule = ls.schedules.InverseTimeDecay(0.1, decay_steps=1, decay_rate=0.5)
        >>> round(float(schedule(2)), 6)
        0.05
    """

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        decay_rate: float,
        staircase: bool = False,
        name: str = "InverseTimeDecay",
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
        return self.initial_learning_rate / (1.0 + self.decay_rate * p)

    get_config = _common.signature_config
