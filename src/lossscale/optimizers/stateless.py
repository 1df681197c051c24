"""`stateless_apply`: the apply pipeline run against given values.

Stateless application is not a second implementation: each variable is
temporarily bound to the given value (a copy on NumPy and torch, whose
updates write in place), the ordinary `apply` pipeline runs, the results are
read back and the bindings restored. Under `jax.jit` the values are tracers,
so the same code compiles.
"""

from __future__ import annotations

from collections.abc import Sequence

from lossscale.backends import _common
from lossscale.optimizers import gradients
from lossscale.typing import Array


class StatelessMixin:
    """`stateless_apply` for `Optimizer`."""

    # True while this optimizer's `stateless_apply` runs: nothing the caller
    # passed may be written, so fast paths that reuse gradient buffers stand
    # aside. An attribute, not a context variable: `torch.compile` traces it.
    _stateless = False

    def stateless_apply(
        self,
        optimizer_variables: Sequence[Array],
        grads: Sequence[Array | None],
        trainable_variables: Sequence[Array],
    ) -> tuple[list[Array], list[Array]]:
        """Stateless version of `apply` that returns modified values.

        Runs the same update as `apply` against the given values and leaves
        every variable of the optimizer and the model as it was. On NumPy and
        torch the inputs are copied first; on JAX it traces under `jax.jit`.

        Args:
            optimizer_variables: Values for `optimizer.variables`, in order.
            grads: Gradients to apply.
            trainable_variables: Values for the model variables the optimizer
                was built with, in order.

        Returns:
            A tuple `(new_trainable_values, new_optimizer_values)`.
        """
        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {type(self).__name__} must be built (i.e. its "
                "variables must have been created). Call `optimizer.build(trainable_variables)`."
            )
        own, model = self.variables, self._trainable_variables
        optimizer_variables, trainable_variables = (
            list(optimizer_variables),
            list(trainable_variables),
        )
        gradients.check_values("optimizer_variables", optimizer_variables, own)
        gradients.check_values("trainable_variables", trainable_variables, model)
        grads = list(grads)
        self._resolve_variables(grads, None)
        grads = gradients.validate_gradients(grads, model)
        ops = self._ops
        values = [
            ops.copy(x) if ops.MUTABLE else x for x in trainable_variables + optimizer_variables
        ]
        outer, self._stateless = self._stateless, True
        try:
            with _common.bound(model + own, values), ops.quiet():
                self._apply_validated(grads, model)
                new_model = [v.value for v in model]
                new_own = [v.value for v in own]
        finally:
            self._stateless = outer
        return new_model, new_own
