"""AdamW: Adam with decoupled weight decay on by default."""

from __future__ import annotations

from typing import Any

from lossscale import validation
from lossscale.optimizers.adam import Adam
from lossscale.typing import LearningRate


class AdamW(Adam):
    """Optimizer that implements the AdamW algorithm.

    AdamW is Adam (see `Adam` for the moment updates) with decoupled weight
    decay (Loshchilov & Hutter, 2019): before each update every
    non-excluded variable shrinks by `learning_rate * weight_decay` times
    itself, independently of the gradient's moments.

    ```
    w = w - w * weight_decay * learning_rate
    w = adam_update(w, g)
    ```

    Args:
        learning_rate: A float, a `LearningRateSchedule` or a callable.
            Defaults to `0.001`.
        weight_decay: Float >= 0. The decoupled weight-decay rate; unlike
            the other optimizers, it cannot be `None`. Defaults to `0.004`.
        beta_1: Float in [0, 1). Exponential decay rate for the 1st moment
            estimates. Defaults to `0.9`.
        beta_2: Float in [0, 1). Exponential decay rate for the 2nd moment
            estimates. Defaults to `0.999`.
        epsilon: Float > 0. A small constant for numerical stability (the
            "epsilon hat" of the Adam paper). Defaults to `1e-7`.
        amsgrad: Boolean. Whether to apply the AMSGrad variant.
        name: String. Defaults to `"adam_w"`, the name Keras 3 derives from
            the class name.
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
