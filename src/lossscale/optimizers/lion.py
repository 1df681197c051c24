"""Lion: sign-based updates from an interpolated momentum."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale import validation
from lossscale.optimizers.base import Optimizer
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class Lion(Optimizer):
    """Optimizer that implements the Lion algorithm.

    Steps by a sign (Chen et al., 2023): use a learning rate 3-10x smaller
    than AdamW's, and a larger weight decay.

    ```
    w = w - learning_rate * sign(beta_1 * m + (1 - beta_1) * g)
    m = beta_2 * m + (1 - beta_2) * g
    ```

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.001`.
        beta_1: Float in (0, 1]. The rate to combine the current gradient and
            the momentum for the update (with 0 it degenerates to SignSGD).
            Defaults to `0.9`.
        beta_2: Float in [0, 1). The decay rate of the momentum. Defaults to
            `0.99`.
        name: String. Defaults to `"lion"`.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([1.0, 1.0], np.float32))
        >>> opt = ls.optimizers.Lion(learning_rate=0.1)
        >>> opt.apply([np.array([0.5, -3.0], np.float32)], [w])
        >>> w.numpy()
        array([0.9, 1.1], dtype=float32)
    """

    update_kernel = "lion"
    kernel_slots = ("_momentums",)

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        name: str = "lion",
        **kwargs: Any,
    ) -> None:
        validation.check_number("beta_1", beta_1, low=0, low_open=True, high=1)
        validation.check_number("beta_2", beta_2, low=0, high=1, high_open=True)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._momentums = self.add_optimizer_variables(var_list, "momentum")

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        ops, lr, gradient = self._cast_step(variable, learning_rate, gradient)
        dtype = variable.dtype
        beta_1 = ops.cast(self.beta_1, dtype)
        beta_2 = ops.cast(self.beta_2, dtype)
        m = self._momentums[self._get_variable_index(variable)]
        self.assign_sub(variable, lr * ops.sign(m.value * beta_1 + gradient * (1.0 - beta_1)))
        self.assign(m, m.value * beta_2 + gradient * (1.0 - beta_2))
