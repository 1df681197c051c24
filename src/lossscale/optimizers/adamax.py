"""Adamax: Adam with the infinity norm in place of the second moment."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale.optimizers import moments
from lossscale.optimizers.base import Optimizer
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class Adamax(Optimizer):
    """Optimizer that implements the Adamax algorithm.

    Adam with the infinity norm (Kingma & Ba, 2014, section 7) in place of
    the second moment.

    ```
    t = iterations + 1
    m = m + (g - m) * (1 - beta_1)
    u = max(beta_2 * u, abs(g))
    w = w - learning_rate * m / ((1 - beta_1**t) * (u + epsilon))
    ```

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.001`.
        beta_1: Float in [0, 1). Decay rate of the 1st moment. Defaults to `0.9`.
        beta_2: Float in [0, 1). Decay rate of the infinity norm. Defaults to `0.999`.
        epsilon: Float > 0. For numerical stability. Defaults to `1e-7`.
        name: String. Defaults to `"adamax"`.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([1.0], np.float32))
        >>> opt = ls.optimizers.Adamax(learning_rate=0.1)
        >>> opt.apply([np.array([0.5], np.float32)], [w])
        >>> w.numpy().round(4)
        array([0.9], dtype=float32)
    """

    update_kernel = "adamax"
    kernel_slots = ("_m", "_u")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        name: str = "adamax",
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
        self._m, self._u = self.add_optimizer_variables(var_list, ["momentum", "norm"])

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        ops, lr, gradient = self._cast_step(variable, learning_rate, gradient)
        dtype = variable.dtype
        (beta_1_power,) = moments.powers_at_step(self, dtype, self.beta_1)
        index = self._get_variable_index(variable)
        m, u = self._m[index], self._u[index]
        moments.update_average(self, m, gradient, self.beta_1)
        self.assign(u, ops.maximum(u.value * self.beta_2, ops.abs(gradient)))
        self.assign_sub(variable, lr * m.value / ((1 - beta_1_power) * (u.value + self.epsilon)))
