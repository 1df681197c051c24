"""Lamb: Adam steps rescaled per layer by a trust ratio."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale.optimizers import moments
from lossscale.optimizers.base import Optimizer
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class Lamb(Optimizer):
    """Optimizer that implements the Lamb algorithm.

    Adam directions rescaled per variable by a trust ratio (You et al., 2019).

    ```
    t = iterations + 1
    m = m + (g - m) * (1 - beta_1)
    v = v + (g**2 - v) * (1 - beta_2)
    update = (m / (1 - beta_1**t)) / (sqrt(v / (1 - beta_2**t)) + epsilon)
    ratio = norm(w) / norm(update) if norm(w) > 0 and norm(update) > 0 else 1
    w = w - ratio * learning_rate * update
    ```

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.001`.
        beta_1: Float in [0, 1). Decay rate of the 1st moment. Defaults to `0.9`.
        beta_2: Float in [0, 1). Decay rate of the 2nd moment. Defaults to `0.999`.
        epsilon: Float > 0. For numerical stability. Defaults to `1e-7`.
        name: String. Defaults to `"lamb"`.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([3.0, 4.0], np.float32))
        >>> opt = ls.optimizers.Lamb(learning_rate=0.1)
        >>> opt.apply([np.array([1.0, 1.0], np.float32)], [w])
        >>> w.numpy().round(4)  # update (1, 1), ratio 5 / sqrt(2)
        array([2.6464, 3.6464], dtype=float32)
    """

    update_kernel = "lamb"
    kernel_slots = ("_momentums", "_velocities")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        name: str = "lamb",
        **kwargs: Any,
    ) -> None:
        moments.check_rates(beta_1, beta_2, epsilon)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = moments.add_moments(self, var_list)

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        ops, lr, gradient = self._cast_step(variable, learning_rate, gradient)
        dtype = variable.dtype
        beta_1_power, beta_2_power = moments.powers_at_step(self, dtype, self.beta_1, self.beta_2)
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        moments.update_moments(self, m, v, gradient)
        update = (m.value / (1.0 - beta_1_power)) / (
            ops.sqrt(v.value / (1.0 - beta_2_power)) + self.epsilon
        )
        w_norm = ops.sqrt(ops.sum(ops.square(variable.value)))
        u_norm = ops.sqrt(ops.sum(ops.square(update)))
        # The divisor stays nonzero so that the unselected branch is never inf or NaN.
        both_positive = ops.logical_and(w_norm > 0, u_norm > 0)
        ratio = ops.where(both_positive, w_norm / ops.where(u_norm > 0, u_norm, 1.0), 1.0)
        self.assign_sub(variable, ratio * lr * update)
