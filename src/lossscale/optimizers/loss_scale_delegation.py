"""What `LossScaleOptimizer` hands to its inner optimizer as it is.

The wrapper keeps the loss scale; the learning rate, the step count, the
EMA's final values and the weight-decay exclusions are the inner
optimizer's, read and written through these. `param_groups` is not there:
the error says what to use with torch's LR schedulers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable


class InnerDelegationMixin:
    """The inner optimizer's learning rate, iterations, EMA finalisation and decay exclusions."""

    @property
    def param_groups(self) -> NoReturn:
        """Not a `torch.optim.Optimizer`: raises an `AttributeError` that says what to use.

        torch's LR schedulers read `optimizer.param_groups`; a lossscale
        optimizer keeps its learning rate as a variable instead.
        """
        raise AttributeError(
            "'LossScaleOptimizer' object has no attribute 'param_groups': it is not a "
            "torch.optim.Optimizer, so torch's LR schedulers cannot drive it. To use a torch "
            "LR scheduler, wrap the rule as a torch optimizer: "
            "`opt = lossscale.torch.Optimizer(model.parameters(), ls.optimizers.AdamW(...))` "
            "under a `lossscale.torch.GradScaler`, and schedule `opt`; or give the inner "
            "optimizer a `lossscale.schedules` schedule as its `learning_rate`."
        )

    @property
    def learning_rate(self) -> Array:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: LearningRate) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Variable | Array:
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, value: int) -> None:
        self.inner_optimizer.iterations = value

    def finalize_variable_values(self, var_list: Sequence[Variable | Array]) -> None:
        """Delegates to the inner optimizer."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def exclude_from_weight_decay(
        self,
        var_list: Sequence[Variable | Array] | None = None,
        var_names: Sequence[str] | None = None,
    ) -> None:
        """Delegates to the inner optimizer, which applies the weight decay."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)
