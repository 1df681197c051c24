"""FTRL-Proximal: follow the regularized leader, with L1/L2 shrinkage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale import validation
from lossscale.optimizers.base import Optimizer
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class Ftrl(Optimizer):
    """Optimizer that implements the FTRL algorithm.

    "Follow The Regularized Leader" (McMahan et al., 2013), for shallow
    models with large, sparse feature spaces.

    ```
    n_new = n + g**2                                   # n starts at initial_accumulator_value
    g_shrunk = g + 2 * l2_shrinkage_regularization_strength * w
    sigma = (n_new**(-learning_rate_power) - n**(-learning_rate_power)) / learning_rate
    z = z + g_shrunk - sigma * w
    quadratic = n_new**(-learning_rate_power) / learning_rate
                + 2 * (l2_regularization_strength + beta / (2 * learning_rate))
    w = (clip(z, -l1, l1) - z) / quadratic             # l1 = l1_regularization_strength
    n = n_new
    ```

    `n` is the variable's `accumulator` slot, `z` its `linear` slot.

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.001`.
        learning_rate_power: Float <= 0. Controls how the learning rate
            decreases during training; use zero for a fixed learning rate.
            Defaults to `-0.5`.
        initial_accumulator_value: Float >= 0. The starting value for the
            accumulators. Defaults to `0.1`.
        l1_regularization_strength: Float >= 0. Defaults to `0.0`.
        l2_regularization_strength: Float >= 0. Stabilization penalty, only
            on active weights (the L2 penalty of the paper). Defaults to
            `0.0`.
        l2_shrinkage_regularization_strength: Float >= 0. A magnitude
            penalty added to the loss, whose gradient `2 * strength * w`
            is added to the gradient. Defaults to `0.0`.
        beta: Float >= 0. The beta value from the paper. Defaults to `0.0`.
        name: String. Defaults to `"ftrl"`.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([0.0, 0.0], np.float32))
        >>> opt = ls.optimizers.Ftrl(learning_rate=1.0, initial_accumulator_value=0.0,
        ...                          l1_regularization_strength=0.5)
        >>> opt.apply([np.array([2.0, 0.25], np.float32)], [w])
        >>> w.numpy()  # z = (2, 0.25): beyond l1 the weight moves, within it stays 0
        array([-0.75,  0.  ], dtype=float32)
    """

    update_kernel = "ftrl"
    kernel_slots = ("_accumulators", "_linears")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        learning_rate_power: float = -0.5,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        l2_shrinkage_regularization_strength: float = 0.0,
        beta: float = 0.0,
        name: str = "ftrl",
        **kwargs: Any,
    ) -> None:
        check = validation.check_number
        check("learning_rate_power", learning_rate_power, high=0)
        check("initial_accumulator_value", initial_accumulator_value, low=0)
        check("l1_regularization_strength", l1_regularization_strength, low=0)
        check("l2_regularization_strength", l2_regularization_strength, low=0)
        check("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength, low=0)
        check("beta", beta, low=0)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.learning_rate_power = learning_rate_power
        self.initial_accumulator_value = initial_accumulator_value
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        self.l2_shrinkage_regularization_strength = l2_shrinkage_regularization_strength
        self.beta = beta

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._accumulators, self._linears = self.add_optimizer_variables(
            var_list,
            ["accumulator", "linear"],
            initializer=[float(self.initial_accumulator_value), "zeros"],
        )

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        ops, lr, gradient = self._cast_step(variable, learning_rate, gradient)
        index = self._get_variable_index(variable)
        accumulator, linear = self._accumulators[index], self._linears[index]
        power = -self.learning_rate_power
        l2 = self.l2_regularization_strength + self.beta / (2.0 * lr)
        w = variable.value
        shrunk_gradient = gradient + 2 * self.l2_shrinkage_regularization_strength * w
        new_accumulator = accumulator.value + ops.square(gradient)
        new_root = ops.power(new_accumulator, power)
        sigma = (new_root - ops.power(accumulator.value, power)) / lr
        self.assign_add(linear, shrunk_gradient - sigma * w)
        quadratic = new_root / lr + 2 * l2
        l1 = self.l1_regularization_strength
        z = linear.value
        self.assign(variable, (ops.clip(z, -l1, l1) - z) / quadratic)
        self.assign(accumulator, new_accumulator)
