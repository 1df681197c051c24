"""`summary()` and `check()`: the loss-scale state read on the host.

A mixin of `LossScaleOptimizer`, kept apart from the step: these methods read
values back to the host (a device synchronisation on an accelerator) and are
meant for loggers and for the checks between steps, never for the hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale.mixed_precision.loss_scale import NO_ERROR, state_fields
from lossscale.mixed_precision.telemetry import LossScaleError, as_numpy, failure_message, summarize
from lossscale.typing import Array


class HostReadsMixin:
    """Host-side reading of `LossScaleOptimizer`'s state."""

    def summary(self, optimizer_variables: Sequence[Array] | None = None) -> dict[str, Any]:
        """Returns the loss-scale state as a dict of Python values, for loggers.

        Reads the values back to the host (a device synchronisation on an
        accelerator): call it when logging, not inside the step.

        Args:
            optimizer_variables: Optional values for `optimizer.variables`
                (as passed to and returned by `stateless_apply`). Defaults to
                the optimizer's own variables.

        Returns:
            A dict with `dynamic_scale` and `step_counter`, and, as the
            settings track them, `consecutive_skips`, `steps`,
            `skipped_steps`, `last_overflow_step`, `scale_history`,
            `nonfinite_variables` (paths), `error`, `error_step`,
            `overflows` (the overflow window, oldest first: `{"step",
            "variables", "module", "loss_finite"}` each) and, with
            `diagnostics_every`, `float16_range` and `float16_range_step`.
        """
        state = self._read_state(self._values_by_id(optimizer_variables))
        values = as_numpy(
            self._ops, {f.name: getattr(state, f.name) for f in state_fields(self.policy)}
        )
        values.setdefault("nonfinite", [])
        modules = {}
        if self.policy.records_details:
            steps = [int(s) for s in values["overflow_steps"] if int(s) >= 0]
            modules = self._overflow_modules(steps)
        paths = [v.path for v in self._trainable_variables]
        return summarize(values, self.policy, paths, modules)

    def _overflow_modules(self, steps: list[int]) -> dict[int, str | None]:
        """`{step: module}` of the overflows at `steps`: none known without observers."""
        return {}

    def check(self, optimizer_variables: Sequence[Array] | None = None) -> None:
        """Raises `LossScaleError` if the state records a crossed limit.

        `apply` calls it after every step when `min_scale` or
        `max_consecutive_skips` is set (reading one scalar); call it
        yourself after `stateless_apply` (for example every few steps of a
        `jax.jit` loop), with the values it returned. Without those limits
        there is nothing to check and nothing is read.

        Args:
            optimizer_variables: Optional values for `optimizer.variables`.
                Defaults to the optimizer's own variables.
        """
        if not self.policy.fails_fast:
            return
        values = self._values_by_id(optimizer_variables)
        error = self._state["error"]
        code = self._ops.to_numpy(error.value if values is None else values[id(error)])
        if int(code) != NO_ERROR:
            raise LossScaleError(failure_message(self.summary(optimizer_variables), self.policy))

    def _values_by_id(self, optimizer_variables):
        if optimizer_variables is None:
            return None
        optimizer_variables = list(optimizer_variables)
        own = self.variables
        if len(optimizer_variables) != len(own):
            raise ValueError(
                "`optimizer_variables` must hold one value per optimizer variable "
                f"({len(own)}). Received: {len(optimizer_variables)} values"
            )
        return {id(v): x for v, x in zip(own, optimizer_variables)}
