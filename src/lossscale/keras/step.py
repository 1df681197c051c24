"""The loss-scale part of one Keras step: unscale, check, next state.

Pure functions of backend arrays (the Keras variables' values), run with the
lossscale backend module of Keras's backend (`lossscale.backends.get_ops`):
the same `unscale`, finite checks and `next_loss_scale` every other
lossscale interface runs. What the wrapper adds around them is only where
the values come from and go to (`optimizer.py`) and how the inner step is
skipped (`gates.py`).
"""

from __future__ import annotations

from lossscale.keras import gates
from lossscale.mixed_precision import diagnostics, inspection
from lossscale.mixed_precision.loss_scale import (
    LossScaleState,
    may_apply,
    next_loss_scale,
    state_fields,
)
from lossscale.mixed_precision.state import replaced


def unscale(ops, grads, overwrite, scale):
    """`grads` divided by `scale`, except `None`s and overwrite-with-gradient ones.

    Args:
        ops: The lossscale backend module.
        grads: The scaled gradients (`None` entries allowed).
        overwrite: For each gradient, whether its variable takes it as is.
        scale: The loss scale (float32 scalar).

    Returns:
        `(unscaled, divided)`: the list of gradients, and the indices divided.
    """
    divided = [i for i, (g, o) in enumerate(zip(grads, overwrite)) if g is not None and not o]
    unscaled = list(grads)
    for i, g in zip(divided, ops.unscale([grads[i] for i in divided], scale)):
        unscaled[i] = g
    return unscaled, divided


def inspect(ops, grads, unscaled, divided, scale, policy, variable_index, variable_count):
    """`(finite, peak, variable_finite)` of the gradients for `next_loss_scale`.

    The flag alone is the unscaled gradients' check; a statistic (the
    headroom policy's peak, telemetry's per-variable flags) is
    `inspection.inspect` of the scaled gradients' peaks. Either catches a
    finite gradient that overflows when divided by a tiny scale.

    Args:
        ops: The lossscale backend module.
        grads: The scaled gradients (`None` entries allowed).
        unscaled: What `unscale` made of them.
        divided: The indices `unscale` divided.
        scale: The loss scale.
        policy: The `LossScalePolicy`.
        variable_index: For each gradient, the index of its variable in the
            optimizer's build order.
        variable_count: How many variables the optimizer was built with.
    """
    if not policy.records_details and policy.growth_policy != "headroom":
        return ops.all_finite([g for g in unscaled if g is not None]), None, ()
    peaks = inspection.gradient_peaks(ops, grads, divided, policy.records_details)
    return inspection.inspect_gradients(
        ops,
        peaks,
        {i: unscaled[i] for i in divided},
        scale,
        policy,
        variable_index.__getitem__,
        variable_count,
    )


def measured(ops, state, grads, policy, variable_index, due):
    """`state` with the scaled `grads`' float16 range in its `range_*` vectors where `due`.

    Args:
        ops: The lossscale backend module.
        state: The current `LossScaleState`.
        grads: The scaled gradients (`None` entries allowed).
        policy: The `LossScalePolicy` (with `diagnostics_every`).
        variable_index: See `inspect`.
        due: Whether this step is measured: a Python bool where the host
            decided, else a backend boolean (the branch then runs under
            the backend's conditional, `gates.run_stateless`).
    """
    present = [
        (variable_index[i], g)
        for i, g in enumerate(grads)
        if g is not None and 0 not in ops.shape(g)
    ]
    if due is False or not present:
        return state
    old = tuple(getattr(state, name) for name in diagnostics.FIELDS)

    def measure():
        indices, values = [i for i, _ in present], [g for _, g in present]
        return diagnostics.measure_at(ops, values, policy.growth_factor, old, indices)

    new = measure() if due is True else gates.run_stateless(ops.NAME, due, measure, lambda: old)
    return replaced(state, **dict(zip(diagnostics.FIELDS, new)))


def decide(
    ops,
    state,
    grads,
    unscaled,
    divided,
    scale,
    policy,
    variable_index,
    variable_count,
    agree,
    measured=None,
):
    """`(take, new_state)`: whether the inner step is applied, and the next loss-scale state.

    Args:
        ops: The lossscale backend module.
        state: The current `LossScaleState` (backend scalars).
        grads: The scaled gradients.
        unscaled, divided: What `unscale` returned for them.
        scale: The loss scale they were divided by.
        policy: The `LossScalePolicy`.
        variable_index: See `inspect`.
        variable_count: See `inspect`.
        agree: `(flag) -> flag` and `(peak) -> peak` reductions over the
            replicas that must take one decision, as a pair of callables.
        measured: With `diagnostics_every`: whether this step measured
            the float16 range (`next_loss_scale`'s `measured`).
    """
    finite, peak, variable_finite = inspect(
        ops, grads, unscaled, divided, scale, policy, variable_index, variable_count
    )
    all_true, all_max = agree
    finite = all_true(finite)
    if peak is not None:
        peak = all_max(peak)
    take = may_apply(ops, state, finite, policy)
    new = next_loss_scale(
        ops,
        state,
        finite,
        policy,
        peak=peak,
        variable_finite=variable_finite,
        in_place=False,
        measured=measured,
    )
    return take, new


def state_of(variables_by_field, read):
    """The `LossScaleState` held by `{field: variable or tuple of them}`, each read by `read`."""
    return LossScaleState(
        **{
            name: tuple(map(read, target)) if isinstance(target, tuple) else read(target)
            for name, target in variables_by_field.items()
        }
    )


def flat_items(state_or_variables):
    """`(field, index)` -> value pairs of a state or of `{field: variable(s)}`, in field order."""
    items = (
        state_or_variables.items()
        if isinstance(state_or_variables, dict)
        else ((f, getattr(state_or_variables, f)) for f in LossScaleState.__dataclass_fields__)
    )
    for name, value in items:
        if isinstance(value, tuple):
            yield from (((name, i), x) for i, x in enumerate(value))
        elif value is not None:
            yield (name, None), value


def extra_fields(policy):
    """`(field, variable name, dtype, initial, per)` of the state Keras's wrapper lacks.

    Keras's wrapper holds `scale` (`dynamic_scale`) and `counter`
    (`step_counter`); hysteresis, telemetry and the fail-fast limits add the
    fields they track. `per` is `"step"`, `"history"` (`history_length`
    scalars), `"variable"` (one per model variable) or `"vector"` (one
    vector, an entry per model variable).
    """
    out = []
    for f in state_fields(policy):
        if f.name in ("scale", "counter"):
            continue
        meta = f.metadata
        out.append(
            (f.name, meta["variable"] or f.name, meta["dtype"], meta["initial"], meta["per"])
        )
    return out
