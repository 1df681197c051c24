"""Adagrad: per-parameter rates scaled by the sum of past squared gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale import validation
from lossscale.optimizers.base import Optimizer
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class Adagrad(Optimizer):
    """Optimizer that implements the Adagrad algorithm.

    ```
    accumulator = accumulator + g**2      # starts at initial_accumulator_value
    w = w - learning_rate * g / sqrt(accumulator + epsilon)
    ```

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.001`.
        initial_accumulator_value: Float >= 0. Starting value of the
            accumulators. Defaults to `0.1`.
        epsilon: Float > 0. For numerical stability. Defaults to `1e-7`.
        name: String. Defaults to `"adagrad"`.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([1.0], np.float32))
        >>> opt = ls.optimizers.Adagrad(learning_rate=0.1, initial_accumulator_value=0.0)
        >>> opt.apply([np.array([2.0], np.float32)], [w])
        >>> w.numpy().round(4)  # 1 - 0.1 * 2 / sqrt(4)
        array([0.9], dtype=float32)
    """

    update_kernel = "adagrad"
    kernel_slots = ("_accumulators",)

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        initial_accumulator_value: float = 0.1,
        epsilon: float = 1e-7,
        name: str = "adagrad",
        **kwargs: Any,
    ) -> None:
        validation.check_number("initial_accumulator_value", initial_accumulator_value, low=0)
        validation.check_number("epsilon", epsilon, low=0, low_open=True)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.initial_accumulator_value = initial_accumulator_value
        self.epsilon = epsilon

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._accumulators = self.add_optimizer_variables(
            var_list, "accumulator", initializer=float(self.initial_accumulator_value)
        )

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        ops, lr, gradient = self._cast_step(variable, learning_rate, gradient)
        accumulator = self._accumulators[self._get_variable_index(variable)]
        self.assign_add(accumulator, ops.square(gradient))
        self.assign_sub(variable, lr * gradient / ops.sqrt(accumulator.value + self.epsilon))
