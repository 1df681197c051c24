"""What `LossScaleOptimizer` records to say why a step overflowed or underflowed.

- `scale_loss` records whether the loss itself was finite (`loss_finite`,
  with telemetry), so an overflow caused by a NaN loss reads as such;
- every `diagnostics_every` steps, each variable's scaled gradient is
  measured against float16's range (`mixed_precision.diagnostics.measure`)
  into the `range_*` state variables, before the gradients are unscaled;
- observers (`lossscale.torch.watch`) hear of every step and say where an
  overflow started.

Nothing here reads a device value on the host during a step: the cadence is
a host count where the backend re-runs Python each step (`host_control()`),
else a branch on the device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lossscale.mixed_precision import diagnostics
from lossscale.typing import Array


class LossScaleDiagnosticsMixin:
    """`scale_loss`'s loss flag, the float16-range measurement and step observers."""

    def _record_loss(self, loss):
        """Stores whether `loss` is finite in the `loss_finite` state variable (no host read).

        A traced loss (inside `jax.grad` or `jax.jit`) cannot be kept in a
        variable: it is not recorded, and the step reports the loss as
        unknown.
        """
        ops = self._ops
        is_traced = getattr(ops, "is_traced", None)
        if is_traced is not None and is_traced(loss):
            return
        if ops.is_native(loss):
            flag = ops.cast(ops.isfinite(loss), ops.INT_DTYPE)
            if ops.shape(flag):  # a loss per example: finite only if all are
                flag = ops.cast(ops.sum(1 - flag) == 0, ops.INT_DTYPE)
        else:
            flag = int(math.isfinite(float(loss)))
        self._state["loss_finite"].assign(flag)

    def _measure_range(self, grads: Sequence[Array | None], variables: Sequence) -> Any:
        """Measures the scaled gradients into the `range_*` variables when this step is due.

        Returns the `measured` flag of `next_loss_scale`: a Python bool where
        the host decided, else a device boolean. Variables without a
        gradient this step keep their last measurement.
        """
        ops, policy = self._ops, self.policy
        host = ops.host_control() and not self._stateless
        if host:
            due = self._host_steps % policy.diagnostics_every == 0
            self._host_steps += 1
            if not due:  # the common step: nothing more to look at
                return False
        targets = [
            (self._get_variable_index(v), g)
            for g, v in zip(grads, variables)
            if g is not None and ops.shape(g).count(0) == 0
        ]
        fields = [self._state[name] for name in diagnostics.FIELDS]

        participants = self._participants

        def write():
            if targets:
                diagnostics.measure_into(
                    ops,
                    [g for _, g in targets],
                    policy.growth_factor,
                    fields,
                    [i for i, _ in targets],
                )
            if self.axis_name is not None:  # replicated inside `shard_map`
                columns = tuple(f.value for f in fields)
                for field, value in zip(
                    fields, diagnostics.over_axes(ops, columns, self.axis_name)
                ):
                    field.assign(value)
            elif host or participants is not None:
                # Each rank measured its own gradients: the statistics policy
                # decides on the near-maximum share and the peak, so every
                # rank takes their largest, and decides alike (as the finite
                # flag is agreed: over `process_group`, the default group if
                # None, on the host; compiled torch's ranks in the branch).
                for name in ("range_near_max", "range_max_abs"):
                    value = self._state[name].value
                    agreed = ops.all_max(value, participants)
                    if agreed is not value:  # one process: its own, nothing to write
                        self._state[name].assign(agreed)

        if host:
            write()
            return True
        due = diagnostics.due(policy, self._state["steps"].value)
        ops.cond(due, write, None, fields)
        return due

    def __getstate__(self) -> dict[str, Any]:
        """What a copy takes (see `Optimizer.__getstate__`), without the observers.

        An observer is bound to a model (`lossscale.torch.watch` hooks its
        modules): a copy starts with none, as a copy of a torch optimizer
        starts without its hooks.
        """
        state = super().__getstate__()
        state["_observers"] = []
        return state

    # --- loading: the host's count of steps follows the restored one ---------
    def load_own_variables(self, store: Mapping[str, Array]) -> None:
        """Restores the variables from `store` (see `Optimizer.load_own_variables`)."""
        super().load_own_variables(store)
        self._restart_host_count()

    def set_weights(self, weights: Sequence[Array]) -> None:
        """Sets every variable from `weights` (see `Optimizer.set_weights`)."""
        super().set_weights(weights)
        self._restart_host_count()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the state written by `state_dict()` (see `Optimizer.load_state_dict`)."""
        super().load_state_dict(state_dict)
        self._restart_host_count()

    def _restart_host_count(self):
        """Sets the host's count of steps (the cadence of `diagnostics_every`) to `steps`.

        One host read, at a load: a resumed run measures on the steps the
        uninterrupted one does.
        """
        steps = self._state.get("steps")
        if self.policy.diagnoses and steps is not None:
            self._host_steps = int(steps.numpy())

    def _notify_observers(self, finite: Array, step: Array | None) -> None:
        if not self._observers:
            return
        if step is not None and self._ops.MUTABLE:
            step = self._ops.copy(step)  # the state's own buffer is written in place next
        for observer in list(self._observers):
            observer.on_step(finite, step)

    def _overflow_modules(self, steps: list[int]) -> dict[int, str | None]:
        """`{step: module}` for the overflows at `steps`, from the observers that know it."""
        found = {}
        for observer in self._observers:
            for step, module in observer.modules_at(steps).items():
                if module is not None:
                    found.setdefault(step, module)
        return found

    def snapshot(self) -> dict[str, Any]:
        """The loss-scale state as host values: `summary()`, a copy that later steps leave alone.

        `optimizer.dynamic_scale` is a live variable (a list of it logs the
        final value at every entry); keep snapshots instead.
        """
        return self.summary()

    def register_step_observer(self, observer: Any) -> ObserverHandle:
        """Calls `observer.on_step(finite, step)` in every `apply`, with device values.

        `finite` is the step's agreed skip decision (True: applied), `step`
        the step's index (`None` unless telemetry or diagnostics count
        steps). `summary()` asks `observer.modules_at(steps)` for the
        module where each overflow of the window started. Used by
        `lossscale.torch.watch`. Not called under `stateless_apply`.

        Returns:
            A handle whose `remove()` unregisters the observer.
        """
        self._observers.append(observer)
        return ObserverHandle(self._observers, observer)


class ObserverHandle:
    """What `register_step_observer` returns: `remove()` unregisters the observer."""

    def __init__(self, observers: list, observer: Any) -> None:
        self._observers, self._observer = observers, observer

    def remove(self) -> None:
        """Unregisters the observer (nothing if it already was)."""
        if self._observer in self._observers:
            self._observers.remove(self._observer)
