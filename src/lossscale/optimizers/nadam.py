"""Nadam: Adam with Nesterov momentum."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale.optimizers import moments
from lossscale.optimizers.base import Optimizer
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class Nadam(Optimizer):
    """Optimizer that implements the Nadam algorithm.

    Adam with Nesterov momentum (Dozat, 2015). Unlike Keras 3, the running
    product of the `u_t` is a variable, `u_product`, so saving carries it.

    ```
    t = iterations + 1
    u_t = beta_1 * (1 - 0.5 * 0.96**t);  u_next = beta_1 * (1 - 0.5 * 0.96**(t + 1))
    u_product = u_product * u_t                  # once per step, starts at 1
    m = m + (g - m) * (1 - beta_1)
    v = v + (g**2 - v) * (1 - beta_2)
    m_hat = u_next * m / (1 - u_product * u_next) + (1 - u_t) * g / (1 - u_product)
    v_hat = v / (1 - beta_2**t)
    w = w - learning_rate * m_hat / (sqrt(v_hat) + epsilon)
    ```

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.001`.
        beta_1: Float in [0, 1). Decay rate of the 1st moment. Defaults to `0.9`.
        beta_2: Float in [0, 1). Decay rate of the 2nd moment. Defaults to `0.999`.
        epsilon: Float > 0. For numerical stability. Defaults to `1e-7`.
        name: String. Defaults to `"nadam"`.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([1.0], np.float32))
        >>> opt = ls.optimizers.Nadam(learning_rate=0.1)
        >>> opt.apply([np.array([0.5], np.float32)], [w])
        >>> w.numpy().round(4), opt.variables[-1].name
        (array([0.8937], dtype=float32), 'u_product')
    """

    update_kernel = "nadam"
    kernel_slots = ("_momentums", "_velocities")
    kernel_hyperparameters = ("schedule_decay",)
    # Keras's fixed decay of Dozat's momentum schedule (a kernel reads it here).
    schedule_decay = 0.96

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        name: str = "nadam",
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
        self._u_product = self.add_variable(
            (), initializer=1.0, dtype=self._trainable_variables[0].dtype, name="u_product"
        )

    def _kernel_slot_lists(self):
        # The product is one scalar shared by every variable's update.
        lists = super()._kernel_slot_lists()
        lists["u_product"] = [self._u_product] * len(self._trainable_variables)
        return lists

    def _update(self, ops, grads, variables, plan, grad_scale=None, keep=None, found_inf=None):
        # Once per step that updates, before any variable: in step with `iterations`.
        u_product = self._u_product
        step = ops.cast(self.iterations + 1, u_product.dtype)
        u_t = self.beta_1 * (1.0 - 0.5 * ops.power(self.schedule_decay, step))
        new = u_product.value * u_t
        self.assign(u_product, new if keep is None else ops.where(keep, new, u_product.value))
        super()._update(ops, grads, variables, plan, grad_scale, keep, found_inf)

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        ops, lr, gradient = self._cast_step(variable, learning_rate, gradient)
        dtype = variable.dtype
        step = ops.cast(self.iterations + 1, dtype)
        decay = ops.cast(self.schedule_decay, dtype)
        beta_1 = ops.cast(self.beta_1, dtype)
        u_t = beta_1 * (1.0 - 0.5 * ops.power(decay, step))
        u_next = beta_1 * (1.0 - 0.5 * ops.power(decay, step + 1))
        u_product = ops.cast(self._u_product.value, dtype)
        u_product_next = u_product * u_next
        (beta_2_power,) = moments.powers_at_step(self, dtype, self.beta_2)
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        moments.update_moments(self, m, v, gradient)
        m_hat = u_next * m.value / (1 - u_product_next) + (1 - u_t) * gradient / (1 - u_product)
        v_hat = v.value / (1 - beta_2_power)
        self.assign_sub(variable, m_hat * lr / (ops.sqrt(v_hat) + self.epsilon))
