"""AdamW: Adam with decoupled weight decay on by default."""

from __future__ import annotations

from typing import Any

from lossscale import validation
from lossscale.optimizers.adam import Adam
from lossscale.typing import LearningRate


class AdamW(Adam):
    """Optimizer that implements the AdamW algorithm.

    Adam with decoupled weight decay (Loshchilov & Hutter, 2019).

    ```
    w = w - w * weight_decay * learning_rate
    w = adam_update(w, g)
    ```

    Args:
        learning_rate: A float, a schedule or a callable. Defaults to `0.001`.
        weight_decay: Float >= 0. The decoupled weight-decay rate; unlike
            the other optimizers, it cannot be `None`. Defaults to `0.004`.
        beta_1: Float in [0, 1). Decay rate of the 1st moment. Defaults to `0.9`.
        beta_2: Float in [0, 1). Decay rate of the 2nd moment. Defaults to `0.999`.
        epsilon: Float > 0. For numerical stability. Defaults to `1e-7`.
        amsgrad: Boolean. Whether to apply the AMSGrad variant.
        name: String. Defaults to `"adam_w"`, as in Keras 3.
        **kwargs: Base optimizer arguments (see `Optimizer`).

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.array([1.0], np.float32))
        >>> opt = ls.optimizers.AdamW(learning_rate=0.1, weight_decay=0.5)
        >>> opt.apply([np.array([0.5], np.float32)], [w])
        >>> w.numpy().round(4)  # 1 - 1 * 0.5 * 0.1, then the Adam step of 0.1
        array([0.85], dtype=float32)
    """

    update_kernel = "adam"

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        weight_decay: float | None = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        name: str = "adam_w",
        **kwargs: Any,
    ) -> None:
        validation.check_number("weight_decay", weight_decay, low=0)
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            name=name,
            weight_decay=weight_decay,
            **kwargs,
        )
