"""Adam: adaptive moment estimation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale import validation
from lossscale.optimizers import moments
from lossscale.optimizers.base import Optimizer
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class Adam(Optimizer):
    """Optimizer that implements the Adam algorithm.

    ```
    t = iterations + 1
    alpha = learning_rate * sqrt(1 - beta_2**t) / (1 - beta_1**t)
    m = m + (g - m) * (1 - beta_1)
    v = v + (g**2 - v) * (1 - beta_2)
    v_hat = max(v_hat, v)                    # amsgrad only; then v = v_hat
    w = w - m * alpha / (sqrt(v) + epsilon)
    ```

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.001`.
        beta_1: Float in [0, 1). Decay rate of the 1st moment. Defaults to `0.9`.
        beta_2: Float in [0, 1). Decay rate of the 2nd moment. Defaults to `0.999`.
        epsilon: Float > 0. For numerical stability (the paper's "epsilon hat").
            Defaults to `1e-7`.
        amsgrad: Boolean. Whether to apply the AMSGrad variant.
        name: String. Defaults to `"adam"`.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([1.0], np.float32))
        >>> opt = ls.optimizers.Adam(learning_rate=0.1)
        >>> opt.apply([np.array([0.5], np.float32)], [w])
        >>> w.numpy().round(4)
        array([0.9], dtype=float32)
    """

    update_kernel = "adam"
    kernel_slots = ("_momentums", "_velocities", "_velocity_hats")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        name: str = "adam",
        **kwargs: Any,
    ) -> None:
        moments.check_rates(beta_1, beta_2, epsilon)
        validation.check_bool("amsgrad", amsgrad)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.amsgrad = amsgrad

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = moments.add_moments(self, var_list)
        if self.amsgrad:
            self._velocity_hats = self.add_optimizer_variables(var_list, "velocity_hat")

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        ops, lr, gradient = self._cast_step(variable, learning_rate, gradient)
        dtype = variable.dtype
        beta_1_power, beta_2_power = moments.powers_at_step(self, dtype, self.beta_1, self.beta_2)
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        moments.update_moments(self, m, v, gradient)
        if self.amsgrad:
            v_hat = self._velocity_hats[index]
            self.assign(v_hat, ops.maximum(v_hat.value, v.value))
            v = v_hat
        self.assign_sub(variable, (m.value * alpha) / (ops.sqrt(v.value) + self.epsilon))
