"""One step of `LossScaleOptimizer`: unscale, check, gate the inner step, update the scale.

```
grads = grads / scale                     # overwrite-with-gradient ones untouched
finite = all(isfinite(grads))             # after unscaling: catches an overflow it causes
finite = all ranks agree                  # torch.distributed: one small all-reduce
inner._step(grads, keep=finite)           # a skipped step writes nothing
state = next_loss_scale(state, finite)    # the one state machine
```

The decision stays on the device: it is the `keep` argument of the inner
optimizer's `_step`, whose kernels fold it into their own arithmetic or
writes where they can (torch's fused and multi-tensor kernels, JAX's Adam,
AdamW and SGD: no select of untouched state, no `lax.cond`); any other
inner step runs under `ops.cond`. Nothing reads the flag on the host.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from lossscale.mixed_precision import diagnostics, inspection
from lossscale.mixed_precision.loss_scale import (
    STATE_FIELD_NAMES,
    LossScaleState,
    may_apply,
    next_loss_scale,
)
from lossscale.typing import Array


class LossScaleStepMixin:
    """`_apply_validated` and the finite checks of `LossScaleOptimizer`."""

    _last_applied = None

    def _apply_validated(self, grads, variables):
        ops = self._ops
        scale = self.dynamic_scale.value
        inner = self.inner_optimizer
        skip = None
        # Measured before unscaling: the float16 range is the scaled gradients'.
        measured = self._measure_range(grads, variables) if self.policy.diagnoses else None
        if self._folds_unscale(variables):
            # The inner kernel divides by the scale as it reads each gradient
            # (NumPy's): one pass fewer. Division is monotone, so the largest
            # scaled magnitude over the scale is the largest unscaled one, and
            # the check still catches a gradient that overflows when unscaled.
            present = [g for g in grads if g is not None]
            finite, peak, variable_finite = ops.finite_unscaled(present, scale), None, ()
            grad_scale = scale
        else:
            scaled = [
                i
                for i, (g, v) in enumerate(zip(grads, variables))
                if g is not None and not v.overwrite_with_gradient
            ]
            grads = list(grads)
            # Outside `stateless_apply` the gradients are the caller's to
            # hand over: torch divides them in place, as GradScaler does,
            # instead of allocating unscaled copies.
            to_unscale, in_place = [grads[i] for i in scaled], not self._stateless
            if self.policy.records_details or self.policy.growth_policy == "headroom":
                # Measured before unscaling: torch divides in place.
                peaks = inspection.gradient_peaks(ops, grads, scaled, self.policy.records_details)
                unscaled = ops.unscale(to_unscale, scale, in_place=in_place)
                finite, peak, variable_finite = inspection.inspect_gradients(
                    ops,
                    peaks,
                    dict(zip(scaled, unscaled)),
                    scale,
                    self.policy,
                    lambda i: self._get_variable_index(variables[i]),
                    len(self._trainable_variables),
                )
            else:  # only the flag is needed: torch's AMP kernel may do both at once
                unscaled, finite, skip = ops.unscale_checked(to_unscale, scale, in_place=in_place)
                unscaled_at = set(scaled)
                others = [g for i, g in enumerate(grads) if g is not None and i not in unscaled_at]
                if others:
                    finite, skip = ops.logical_and(finite, ops.all_finite(others)), None
                peak, variable_finite = None, ()
            for i, g in zip(scaled, unscaled):
                grads[i] = g
            grad_scale = None
        # Every process must take the same decision (sharded gradients differ
        # per rank): one small all-reduce where torch.distributed runs.
        agreed = ops.all_true(finite, self._participants)
        if peak is not None:
            peak = ops.all_max(peak, self._participants)
        if self.axis_name is not None and variable_finite:
            # Replicated state inside `shard_map`: each variable's flag is
            # agreed too (torch's ranks keep their own, docs/torch.md).
            variable_finite = inspection.agreed_flags(ops, variable_finite, self.axis_name)
        # The per-variable measurement is read by the statistics policy only:
        # elsewhere its hundred-odd variables would be read every step.
        unread = () if self.policy.growth_policy == "statistics" else diagnostics.FIELDS
        state = self._read_state(unread=unread)
        keep = may_apply(ops, state, agreed, self.policy)
        if agreed is not finite or self.policy.fails_fast:
            # `skip` described the local check only (`all_true` returns its
            # flag itself where there is nothing to agree with).
            skip = None
        # The inner optimizer's validated entry: `apply` has checked the
        # gradients and variables already.
        inner._step(grads, variables, keep=keep, grad_scale=grad_scale, found_inf=skip)
        if not self._stateless:  # never keep a traced value
            self._last_applied = keep
            self._notify_observers(agreed, state.steps)
        new = next_loss_scale(
            ops,
            state,
            agreed,
            self.policy,
            peak=peak,
            variable_finite=variable_finite,
            skip=skip,
            in_place=ops.MUTABLE,
            measured=measured,
        )
        self._write_state(ops, state, new, unread)

    @property
    def last_step_applied(self) -> Array | None:
        """Whether the last `apply` was applied (a backend boolean scalar), or None before one.

        False for a skipped (overflowing) step. A device value on torch:
        reading it on the host (`bool(...)`) waits for the step.
        `stateless_apply` does not set it.
        """
        return self._last_applied

    def _write_state(self, ops, state, new, unread=()):
        """Stores the new loss-scale state in the wrapper's variables.

        Fields named in `unread` were not read into `state`: not written.
        """
        # A field `next_loss_scale` left alone is the state's own value (the
        # per-variable diagnostics fields on most steps): nothing to write.
        changed = {
            name: getattr(new, name)
            for name in self._state
            if name not in unread and not _same(getattr(new, name), getattr(state, name))
        }
        targets = dict(_flatten({name: self._state[name] for name in changed}))
        # Only a written variable's buffer can change under another's value.
        was = {name: getattr(state, name) for name in changed}
        old = {id(x) for _, x in _flatten(was)} if ops.MUTABLE else set()
        writes = []
        for key, value in _flatten(changed):
            variable = targets.get(key)
            if variable is None or value is variable.storage:
                continue  # untracked, or updated in place by a fused kernel
            if id(value) in old:
                # Another variable's buffer passed through unchanged (the
                # shifted scale history): copied before any write changes it.
                value = ops.copy(value)
            writes.append((variable, value))
        for variable, value in writes:
            variable.assign(value)

    def _folds_unscale(self, variables):
        # Not under stateless_apply on a backend that writes in place: such a
        # kernel may leave the unscaled values in the gradient buffers, which
        # belong to the caller there. JAX arrays are immutable, and there the
        # jitted stateless step is the one that gains (no unscaled copy).
        return (
            not (self._stateless and self._ops.MUTABLE)
            and not self.policy.records_details
            and self.policy.growth_policy == "fixed"
            and self.inner_optimizer._takes_grad_scale(variables)
        )

    def _read_state(self, values=None, unread=()):
        """The `LossScaleState` of the variables, or of `values` ({variable id: value}).

        Fields named in `unread` are left out (empty), and so not written back.
        """

        def read(v):
            return v.value if values is None else values[id(v)]

        return LossScaleState(
            **{
                name: tuple(map(read, target)) if isinstance(target, tuple) else read(target)
                for name, target in self._state.items()
                if name not in unread
            }
        )

    def check_finite(self, grads: Sequence[Array | None]) -> Array:
        """Returns a backend boolean scalar: whether every non-`None` gradient is finite."""
        present = [g for g in grads if g is not None]
        return self._ops_of(present).all_finite(present)

    def _ops_of(self, arrays):
        if self.built:
            return self._ops
        from lossscale.backends import ops_for

        return ops_for(*arrays)


def _same(new, old):
    """Whether a field's new value is its old one, object for object."""
    # Element by element: torch.compile traces no identity test of tuples.
    if isinstance(new, tuple):
        return isinstance(old, tuple) and len(new) == len(old) and all(map(operator.is_, new, old))
    return new is old


def _flatten(state):
    """`((field name, index), value)` pairs of a state or of `{field name: variable(s)}`."""
    items = (
        state.items()
        if isinstance(state, dict)
        else ((name, getattr(state, name)) for name in STATE_FIELD_NAMES)
    )
    for name, value in items:
        if isinstance(value, tuple):
            yield from (((name, i), x) for i, x in enumerate(value))
        elif value is not None:
            yield (name, None), value
