"""RMSprop: divide the gradient by a running root mean square of its history."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale import validation
from lossscale.optimizers.base import Optimizer
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class RMSprop(Optimizer):
    """Optimizer that implements the RMSprop algorithm.

    ```
    v = rho * v + (1 - rho) * g**2
    a = rho * a + (1 - rho) * g                # centered only
    denominator = v - a**2 + epsilon           # centered
    denominator = v + epsilon                  # otherwise
    step = learning_rate * g / sqrt(denominator)
    m = momentum * m + step; w = w - m         # momentum > 0
    w = w - step                               # momentum == 0
    ```

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.001`.
        rho: Float in [0, 1). Discounting factor for the old gradients.
            Defaults to `0.9`.
        momentum: Float in [0, 1]. If not 0, the optimizer keeps a momentum
            of the scaled steps, decaying by this factor. Defaults to `0.0`.
        epsilon: Float > 0. For numerical stability. Defaults to `1e-7`.
        centered: Boolean. If `True`, gradients are normalized by the
            estimated variance of the gradient; if `False`, by the
            uncentered second moment. Defaults to `False`.
        name: String. Defaults to `"rm_sprop"`, as in Keras 3.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([10.0], np.float32))
        >>> opt = ls.optimizers.RMSprop(learning_rate=0.1)
        >>> opt.apply([w.numpy()], [w])  # the gradient of w**2 / 2
        >>> w.numpy().round(6)
        array([9.683772], dtype=float32)
    """

    update_kernel = "rmsprop"
    kernel_slots = ("_velocities", "_momentums", "_average_gradients")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        name: str = "rm_sprop",
        **kwargs: Any,
    ) -> None:
        validation.check_number("rho", rho, low=0, high=1, high_open=True)
        validation.check_number("momentum", momentum, low=0, high=1)
        validation.check_number("epsilon", epsilon, low=0, low_open=True)
        validation.check_bool("centered", centered)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.rho = rho
        self.momentum = momentum
        self.epsilon = epsilon
        self.centered = centered

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._velocities = self.add_optimizer_variables(var_list, "velocity")
        self._momentums = (
            self.add_optimizer_variables(var_list, "momentum") if self.momentum > 0 else []
        )
        self._average_gradients = (
            self.add_optimizer_variables(var_list, "average_gradient") if self.centered else []
        )

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        ops, lr, gradient = self._cast_step(variable, learning_rate, gradient)
        index = self._get_variable_index(variable)
        velocity = self._velocities[index]
        self.assign(velocity, velocity.value * self.rho + ops.square(gradient) * (1 - self.rho))
        if self.centered:
            average = self._average_gradients[index]
            self.assign(average, average.value * self.rho + gradient * (1 - self.rho))
            denominator = velocity.value - ops.square(average.value) + self.epsilon
        else:
            denominator = velocity.value + self.epsilon
        increment = lr * gradient / ops.sqrt(denominator)
        if self.momentum > 0:
            momentum = self._momentums[index]
            self.assign(momentum, momentum.value * self.momentum + increment)
            self.assign_sub(variable, momentum.value)
        else:
            self.assign_sub(variable, increment)
