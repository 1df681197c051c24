"""Stochastic gradient descent, with optional (Nesterov) momentum."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale import validation
from lossscale.optimizers.base import Optimizer
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class SGD(Optimizer):
    """Gradient descent (with momentum) optimizer.

    ```
    velocity = momentum * velocity - learning_rate * g   # if momentum > 0
    w = w + momentum * velocity - learning_rate * g      # nesterov
    w = w + velocity                                     # plain momentum
    w = w - learning_rate * g                            # momentum == 0
    ```

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.01`.
        momentum: Float >= 0 that accelerates gradient descent in the
            relevant direction and dampens oscillations. Defaults to `0.0`.
        nesterov: Boolean. Whether to apply Nesterov momentum.
        name: String. Defaults to `"sgd"`.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([1.0], np.float32))
        >>> opt = ls.optimizers.SGD(learning_rate=0.1, momentum=0.9)
        >>> opt.apply([np.array([1.0], np.float32)], [w])
        >>> w.numpy()
        array([0.9], dtype=float32)
    """

    update_kernel = "sgd"
    kernel_slots = ("momentums",)

    def __init__(
        self,
        learning_rate: LearningRate = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        name: str = "sgd",
        **kwargs: Any,
    ) -> None:
        validation.check_number("momentum", momentum, low=0, high=1)
        validation.check_bool("nesterov", nesterov)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum = momentum
        self.nesterov = nesterov

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        if self.built:
            return
        super().build(var_list)
        self.momentums = (
            self.add_optimizer_variables(var_list, "momentum") if self.momentum != 0 else []
        )

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        ops, lr, gradient = self._cast_step(variable, learning_rate, gradient)
        if self.momentum == 0:
            self.assign_sub(variable, gradient * lr)
            return
        m = self.momentums[self._get_variable_index(variable)]
        momentum = ops.cast(self.momentum, variable.dtype)
        self.assign(m, m.value * momentum - gradient * lr)
        if self.nesterov:
            self.assign_add(variable, m.value * momentum - gradient * lr)
        else:
            self.assign_add(variable, m.value)
