"""Adadelta: steps scaled by the ratio of running update and gradient RMS."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale import validation
from lossscale.optimizers.base import Optimizer
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class Adadelta(Optimizer):
    """Optimizer that implements the Adadelta algorithm.

    Steps adapt to a moving window of gradient updates. As in Keras, they are
    multiplied by `learning_rate` (the paper's rule is `learning_rate=1.0`).

    ```
    rms(x) = sqrt(x + epsilon)
    accumulated_grad = rho * accumulated_grad + (1 - rho) * g**2
    delta = -rms(accumulated_delta_var) * g / rms(accumulated_grad)
    accumulated_delta_var = rho * accumulated_delta_var + (1 - rho) * delta**2
    w = w + learning_rate * delta
    ```

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.001`.
        rho: Float in [0, 1). The decay rate. Defaults to `0.95`.
        epsilon: Float > 0. A small constant for numerical stability (it
            also sizes the first steps). Defaults to `1e-7`.
        name: String. Defaults to `"adadelta"`.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([1.0], np.float32))
        >>> opt = ls.optimizers.Adadelta(learning_rate=1.0, rho=0.0, epsilon=1e-2)
        >>> opt.apply([np.array([1.0], np.float32)], [w])
        >>> w.numpy().round(4)  # 1 - sqrt(0.01) * 1 / sqrt(1.01)
        array([0.9005], dtype=float32)
    """

    update_kernel = "adadelta"
    kernel_slots = ("_accumulated_grads", "_accumulated_delta_vars")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        rho: float = 0.95,
        epsilon: float = 1e-7,
        name: str = "adadelta",
        **kwargs: Any,
    ) -> None:
        validation.check_number("rho", rho, low=0, high=1, high_open=True)
        validation.check_number("epsilon", epsilon, low=0, low_open=True)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.rho = rho
        self.epsilon = epsilon

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._accumulated_grads, self._accumulated_delta_vars = self.add_optimizer_variables(
            var_list, ["accumulated_grad", "accumulated_delta_var"]
        )

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        ops, lr, gradient = self._cast_step(variable, learning_rate, gradient)
        index = self._get_variable_index(variable)
        grad_acc = self._accumulated_grads[index]
        delta_acc = self._accumulated_delta_vars[index]
        rho = self.rho
        self.assign(grad_acc, grad_acc.value * rho + ops.square(gradient) * (1 - rho))
        delta = -(
            ops.sqrt(delta_acc.value + self.epsilon)
            * gradient
            / ops.sqrt(grad_acc.value + self.epsilon)
        )
        self.assign(delta_acc, delta_acc.value * rho + ops.square(delta) * (1 - rho))
        self.assign_add(variable, lr * delta)
