"""Cosine schedules: `CosineDecay` (with linear warmup) and `CosineDecayRestarts`."""

from __future__ import annotations

import math

import numpy as np

from lossscale import validation
from lossscale.schedules import _common
from lossscale.schedules.base import LearningRateSchedule
from lossscale.typing import Array


def _cosine(ops, fraction, alpha):
    """`(1 - alpha) * 0.5 * (1 + cos(pi * fraction)) + alpha`."""
    return (1.0 - alpha) * (0.5 * (1.0 + ops.cos(math.pi * fraction))) + alpha


class CosineDecay(LearningRateSchedule):
    """A `LearningRateSchedule` that uses a cosine decay with optional warmup.

    See Loshchilov & Hutter, ICLR 2016, "SGDR: Stochastic Gradient Descent
    with Warm Restarts". With `warmup_target`, a linear warmup comes first.

    ```
    cosine(x) = (1 - alpha) * 0.5 * (1 + cos(pi * x)) + alpha
    # without warmup:
    learning_rate = initial_learning_rate * cosine(min(step, decay_steps) / decay_steps)
    # with warmup (step clipped to warmup_steps + decay_steps):
    learning_rate = (initial_learning_rate
                     + (warmup_target - initial_learning_rate) * step / warmup_steps)
                                                         if step < warmup_steps
    learning_rate = warmup_target * cosine((step - warmup_steps) / decay_steps)
                                                         otherwise
    ```

    Args:
        initial_learning_rate: Float >= 0. The initial learning rate.
        decay_steps: Number > 0. Number of steps to decay over.
        alpha: Float in [0, 1]. Minimum learning rate value for decay as a
            fraction of `initial_learning_rate` (of `warmup_target` with
            warmup). Defaults to `0.0`.
        name: String. Defaults to `"CosineDecay"`.
        warmup_target: Float >= 0 or `None`. The learning rate reached at
            the end of the warmup; `None` means no warmup. Defaults to
            `None`.
        warmup_steps: Number >= 0. Number of steps to warm up over.
            Defaults to `0`.

    Examples:
        >>> import lossscale as ls
        >>> schedule = ls.schedules.CosineDecay(0.0, decay_steps=10, warmup_target=0.1,
        ...                                     warmup_steps=10)
        >>> [round(float(schedule(s)), 6) for s in (0, 5, 10, 15, 20, 99)]
        [0.0, 0.05, 0.1, 0.05, 0.0, 0.0]
    """

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        alpha: float = 0.0,
        name: str = "CosineDecay",
        warmup_target: float | None = None,
        warmup_steps: float = 0,
    ) -> None:
        validation.check_number("initial_learning_rate", initial_learning_rate, low=0)
        _common.check_decay_steps("decay_steps", decay_steps)
        validation.check_number("alpha", alpha, low=0, high=1)
        _common.check_name(name)
        validation.check_number("warmup_target", warmup_target, low=0, allow_none=True)
        validation.check_number("warmup_steps", warmup_steps, low=0)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.alpha = alpha
        self.name = name
        self.warmup_target = warmup_target
        self.warmup_steps = warmup_steps

    def __call__(self, step: Array) -> Array:
        ops, step = _common.float_step(step)
        if self.warmup_target is None:
            step = ops.minimum(step, self.decay_steps)
            return self.initial_learning_rate * _cosine(ops, step / self.decay_steps, self.alpha)
        step = ops.minimum(step, self.decay_steps + self.warmup_steps)
        decayed = self.warmup_target * _cosine(
            ops, (step - self.warmup_steps) / self.decay_steps, self.alpha
        )
        # Both branches are computed (the schedule traces under jit); an unselected
        # warmup branch divides by 1 to stay finite.
        warmup_steps = self.warmup_steps if self.warmup_steps > 0 else 1.0
        warming = (self.warmup_target - self.initial_learning_rate) * (
            step / warmup_steps
        ) + self.initial_learning_rate
        return ops.where(step < self.warmup_steps, warming, decayed)

    get_config = _common.signature_config


class CosineDecayRestarts(LearningRateSchedule):
    """A `LearningRateSchedule` that uses a cosine decay schedule with restarts.

    See Loshchilov & Hutter, ICLR 2016, "SGDR: Stochastic Gradient Descent
    with Warm Restarts". Each period decays like `CosineDecay`, then restarts.

    ```
    x = step / first_decay_steps
    i = floor(x)                                          if t_mul == 1
    i = floor(log(1 - x * (1 - t_mul)) / log(t_mul))      otherwise
    x = x - i                                             if t_mul == 1
    x = (x - (1 - t_mul**i) / (1 - t_mul)) / t_mul**i     otherwise
    learning_rate = initial_learning_rate * (
        (1 - alpha) * m_mul**i * 0.5 * (1 + cos(pi * x)) + alpha)
    ```

    Args:
        initial_learning_rate: Float >= 0. The initial learning rate.
        first_decay_steps: Number > 0. Number of steps to decay over in the
            first period.
        t_mul: Float > 0. Used to derive the number of iterations in the
            i-th period. Defaults to `2.0`.
        m_mul: Float >= 0. Used to derive the initial learning rate of the
            i-th period. Defaults to `1.0`.
        alpha: Float in [0, 1]. Minimum learning rate value as a fraction of
            `initial_learning_rate`. Defaults to `0.0`.
        name: String. Defaults to `"SGDRDecay"`.

    Examples:
        >>> import lossscale as ls
        >>> schedule = ls.schedules.CosineDecayRestarts(0.1, first_decay_steps=10, t_mul=1.0,
        ...                                             m_mul=0.5)
        >>> [round(float(schedule(s)), 6) for s in (0, 5, 10, 15)]
        [0.1, 0.05, 0.05, 0.025]
    """

    def __init__(
        self,
        initial_learning_rate: float,
        first_decay_steps: float,
        t_mul: float = 2.0,
        m_mul: float = 1.0,
        alpha: float = 0.0,
        name: str = "SGDRDecay",
    ) -> None:
        validation.check_number("initial_learning_rate", initial_learning_rate, low=0)
        _common.check_decay_steps("first_decay_steps", first_decay_steps)
        validation.check_number("t_mul", t_mul, low=0, low_open=True)
        validation.check_number("m_mul", m_mul, low=0)
        validation.check_number("alpha", alpha, low=0, high=1)
        _common.check_name(name)
        self.initial_learning_rate = initial_learning_rate
        self.first_decay_steps = first_decay_steps
        self.t_mul = t_mul
        self.m_mul = m_mul
        self.alpha = alpha
        self.name = name

    def __call__(self, step: Array) -> Array:
        ops, step = _common.float_step(step)
        fraction = step / self.first_decay_steps
        t_mul = self.t_mul
        if t_mul == 1.0:
            restarts = ops.floor(fraction)
            fraction = fraction - restarts
        else:
            # The period index in closed form; log(t_mul) in float32, as the rest.
            log_t_mul = float(np.log(np.float32(t_mul)))
            restarts = ops.floor(ops.log(1.0 - fraction * (1.0 - t_mul)) / log_t_mul)
            growth = ops.power(t_mul, restarts)
            fraction = (fraction - (1.0 - growth) / (1.0 - t_mul)) / growth
        decayed = (1.0 - self.alpha) * (
            ops.power(self.m_mul, restarts) * (0.5 * (1.0 + ops.cos(math.pi * fraction)))
        )
        return self.initial_learning_rate * (decayed + self.alpha)

    get_config = _common.signature_config
