"""One loss-scale step, in the order every front end runs it.

```
state = measured(state, grads)        # diagnostics_every: the scaled gradients'
                                      # float16 range, on the steps it is due
check = check(grads, scale)           # unscale (here, or inside the inner kernel)
                                      # and find non-finite gradients: also those
                                      # that overflow only once unscaled
finite = agreed over the participants # torch.distributed ranks, JAX mapped axes,
                                      # tf.distribute replicas: one decision
keep = may_apply(state, finite)       # finite, and no fail-fast error recorded
result = inner(Decision(keep, ...))   # the front end skips its inner step where
                                      # `keep` is False, its own way
state = next_loss_scale(state, finite)
```

`run` is that order, for the front ends that hold the state and skip their
own way; `lossscale.torch.GradScaler` runs the last two lines at `update()`
through `decide` and `advance`. Nothing here reads a device value on the
host: every decision is a select or the backend's conditional.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from lossscale.mixed_precision import diagnostics, inspection
from lossscale.mixed_precision.loss_scale import (
    LossScalePolicy,
    LossScaleState,
    may_apply,
    next_loss_scale,
)
from lossscale.mixed_precision.state import replaced
from lossscale.typing import Array

# How a step unscales its gradients (`Gradients.unscale`).
UNSCALINGS = ("in_place", "copy", "in_kernel", "after_check")


@dataclasses.dataclass(frozen=True)
class Gradients:
    """A step's gradients as the front end hands them over.

    Attributes:
        grads: The scaled gradients (`None` entries allowed).
        divided: For each gradient, whether the step unscales it (False for
            an overwrite-with-gradient variable's, which its variable takes
            as it is).
        index_of: `index_of(i)`: the place of gradient `i`'s variable in the
            optimizer's build order (per-variable flags and measurements).
        variable_count: How many variables that order holds.
        unscale: `"in_place"`: divided in the caller's buffers where the
            backend can; `"copy"`: divided into new arrays; `"in_kernel"`:
            left scaled for the inner kernel (`Decision.grad_scale`);
            `"after_check"`: checked scaled, against the dtype each is
            unscaled to, then divided by `divide_fn`.
        divide_fn: With `"after_check"`: `divide_fn(grads, scale)` returns
            the unscaled gradients (of `unscaled_dtypes`).
        unscaled_dtypes: With `"after_check"`: for each gradient, the dtype
            name it is unscaled to.
    """

    grads: Sequence[Array | None]
    divided: Sequence[bool]
    index_of: Callable[[int], int]
    variable_count: int
    unscale: str = "copy"
    divide_fn: Callable | None = None
    unscaled_dtypes: Sequence[str] | None = None

    def __post_init__(self):
        if self.unscale not in UNSCALINGS:
            raise ValueError(
                f"`unscale` must be one of {UNSCALINGS}. Received: unscale={self.unscale!r}"
            )


@dataclasses.dataclass(frozen=True)
class Participants:
    """Who takes one decision together, and how their flags are combined.

    Attributes:
        group: What `all_true` / `all_max` reduce over: a torch process
            group, JAX axis names, or None.
        per_variable: Whether each variable's flag is agreed too (JAX
            mapped axes, whose state is replicated).
        measurements: How a measurement's columns are agreed: `"axes"`
            (shares averaged, peaks maxed), `"peaks"` (the near-maximum
            share and the peak maxed), or None.
    """

    group: Any = None
    per_variable: bool = False
    measurements: str | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the step decided, for the front end's inner step.

    Attributes:
        keep: Backend boolean scalar: apply the inner step.
        found_inf: `keep` in torch's AMP form (1.0: skipped) where the
            check made it and it is the decision; else None.
        grads: The gradients for the inner step: unscaled, or still scaled
            where `grad_scale` is set.
        grad_scale: The scale still in `grads` (`"in_kernel"`), or None.
        finite: The agreed flag: whether every gradient was finite.
        step: `state.steps` where the policy counts steps, else None.
    """

    keep: Array
    found_inf: Array | None
    grads: list
    grad_scale: Array | None
    finite: Array
    step: Array | None


@dataclasses.dataclass(frozen=True)
class Check:
    """What `check` found in a step's gradients.

    Attributes:
        grads: For the inner step (see `Decision.grads`).
        grad_scale: See `Decision.grad_scale`.
        finite: Boolean scalar, this participant's finite flag.
        found_inf: The same flag in torch's AMP form where the check made
            it, else None.
        peak: The largest scaled magnitude (`growth_policy="headroom"`).
        variable_finite: With telemetry, per variable (build order) a
            boolean scalar or None (no gradient); else `()`.
    """

    grads: list
    grad_scale: Array | None
    finite: Array
    found_inf: Array | None
    peak: Array | None
    variable_finite: tuple


def run(
    ops,
    policy: LossScalePolicy,
    state: LossScaleState,
    gradients: Gradients,
    inner: Callable[[Decision], Any],
    *,
    participants: Participants = Participants(),
    due: Array | bool | None = None,
    in_place: bool = False,
) -> tuple[LossScaleState, Any]:
    """Runs one loss-scale step (see the module docstring).

    Args:
        ops: The backend module of the gradients.
        policy: The `LossScalePolicy`.
        state: The current `LossScaleState`, as the front end holds it.
        gradients: The step's `Gradients`.
        inner: `inner(decision)` runs the inner step where `decision.keep`
            holds (and writes nothing where it does not).
        participants: Who takes the decision together.
        due: With `diagnostics_every`: whether this step is measured (a
            Python bool or a backend boolean).
        in_place: Whether the state's arrays may be overwritten.

    Returns:
        `(new state, inner's result)`.
    """
    if policy.diagnoses:
        state = measured(ops, policy, state, gradients, due, participants)
    found = check(ops, policy, state.scale, gradients)
    decision = decide(ops, policy, state, found, participants)
    peak = None if found.peak is None else ops.all_max(found.peak, participants.group)
    variable_finite = found.variable_finite
    if participants.per_variable and variable_finite:
        variable_finite = inspection.agreed_flags(ops, variable_finite, participants.group)
    result = inner(decision)
    new = advance(
        ops,
        policy,
        state,
        decision.finite,
        peak=peak,
        variable_finite=variable_finite,
        found_inf=decision.found_inf,
        in_place=in_place,
        measured=due if policy.diagnoses else None,
    )
    return new, result


def measured(ops, policy, state, gradients, due, participants=Participants()):
    """`state` with this step's float16 range in its `range_*` vectors where `due`.

    A variable without a gradient keeps its last measurement; a device `due`
    runs the measurement under a backend conditional.
    """
    grads = gradients.grads
    present = [
        (gradients.index_of(i), g)
        for i, g in enumerate(grads)
        if g is not None and 0 not in ops.shape(g)
    ]
    if due is False or due is None or not present:
        return state
    old = tuple(getattr(state, name) for name in diagnostics.FIELDS)

    def measure():
        indices, values = [i for i, _ in present], [g for _, g in present]
        columns = diagnostics.measure_at(ops, values, policy.growth_factor, old, indices)
        return _agreed_columns(ops, columns, participants)

    new = measure() if due is True else ops.cond_values(due, measure, lambda: old)
    return replaced(state, **dict(zip(diagnostics.FIELDS, new)))


def check(ops, policy: LossScalePolicy, scale: Array, gradients: Gradients) -> Check:
    """Unscales the gradients as `gradients.unscale` says and finds the non-finite ones.

    The flag alone is the backend's fused check (`unscale_checked`,
    `finite_unscaled`); statistics are `inspection.inspect` of the peaks,
    taken before any in-place division. Either way a gradient that
    overflows once unscaled counts as non-finite.
    """
    grads, mode = list(gradients.grads), gradients.unscale
    details = policy.records_details or policy.growth_policy == "headroom"
    if mode == "in_kernel":
        present = [g for g in grads if g is not None]
        return Check(grads, scale, ops.finite_unscaled(present, scale), None, None, ())
    divided = [i for i, g in enumerate(grads) if g is not None and gradients.divided[i]]
    if mode == "after_check":
        return _check_then_divide(ops, policy, scale, gradients, grads, divided, details)
    to_unscale, in_place = [grads[i] for i in divided], mode == "in_place"
    found_inf, peak, variable_finite = None, None, ()
    if details:
        # Measured before unscaling: torch divides in place.
        peaks = inspection.gradient_peaks(ops, grads, divided, policy.records_details)
        unscaled = ops.unscale(to_unscale, scale, in_place=in_place)
        finite, peak, variable_finite = inspection.inspect_gradients(
            ops,
            peaks,
            dict(zip(divided, unscaled)),
            scale,
            policy,
            gradients.index_of,
            gradients.variable_count,
        )
    else:
        unscaled, finite, found_inf = ops.unscale_checked(to_unscale, scale, in_place=in_place)
        at = set(divided)
        others = [g for i, g in enumerate(grads) if g is not None and i not in at]
        if others:  # overwrite-with-gradient ones: checked as they are
            finite, found_inf = ops.logical_and(finite, ops.all_finite(others)), None
    for i, g in zip(divided, unscaled):
        grads[i] = g
    return Check(grads, None, finite, found_inf, peak, variable_finite)


def _check_then_divide(ops, policy, scale, gradients, grads, divided, details):
    """`check` of the scaled gradients against their unscaled dtypes, then `divide_fn`."""
    dtypes = gradients.unscaled_dtypes
    peak, variable_finite = None, ()
    if policy.records_details:
        peaks = [ops.max_abs([grads[i]]) if 0 not in ops.shape(grads[i]) else None for i in divided]
        found = inspection.inspect(ops, peaks, [dtypes[i] for i in divided], scale, policy)
        finite, peak = found.finite, found.peak
        variable_finite = [None] * gradients.variable_count
        for i, flag in zip(divided, found.variable_finite):
            variable_finite[gradients.index_of(i)] = flag
        variable_finite = tuple(variable_finite)
    else:
        groups = {}
        for i in divided:
            groups.setdefault(dtypes[i], []).append(grads[i])
        if details:  # the headroom policy's peak, one per dtype
            peaks = [ops.max_abs(group) for group in groups.values()]
            found = inspection.inspect(ops, peaks, list(groups), scale, policy)
            finite, peak = found.finite, found.peak
        else:
            flags = [_finite_unscaled_as(ops, group, scale, d) for d, group in groups.items()]
            finite = functools.reduce(ops.logical_and, flags) if flags else ops.isfinite(scale)
    for i, g in zip(divided, gradients.divide_fn([grads[i] for i in divided], scale)):
        grads[i] = g
    return Check(grads, None, finite, None, peak, variable_finite)


def decide(ops, policy, state, found: Check, participants=Participants()) -> Decision:
    """The agreed decision of a step from its `check` (see `Decision`)."""
    finite = ops.all_true(found.finite, participants.group)
    found_inf = found.found_inf
    if found_inf is not None and (
        policy.fails_fast or ops.several_participants(participants.group)
    ):
        found_inf = None  # the local check is not the decision
    return Decision(
        keep=may_apply(ops, state, finite, policy),
        found_inf=found_inf,
        grads=found.grads,
        grad_scale=found.grad_scale,
        finite=finite,
        step=state.steps,
    )


def advance(
    ops,
    policy: LossScalePolicy,
    state: LossScaleState,
    finite: Array,
    *,
    peak: Array | None = None,
    variable_finite: Sequence[Array | None] = (),
    found_inf: Array | None = None,
    in_place: bool = False,
    measured: Array | bool | None = None,
    scale_at_least: float = 0.0,
) -> LossScaleState:
    """`next_loss_scale` of the agreed flag (`found_inf` is its `skip`)."""
    return next_loss_scale(
        ops,
        state,
        finite,
        policy,
        peak=peak,
        variable_finite=variable_finite,
        skip=found_inf,
        in_place=in_place,
        measured=measured,
        scale_at_least=scale_at_least,
    )


def _finite_unscaled_as(ops, group, scale, dtype):
    """Whether `group / scale`, cast to `dtype`, is finite (narrower dtypes: on the peak)."""
    if dtype in ("float32", "float64"):
        return ops.finite_unscaled(group, scale)
    return ops.isfinite(ops.cast(ops.max_abs(group) / scale, dtype))


def _agreed_columns(ops, columns, participants):
    """A measurement's columns agreed over the participants (see `Participants`)."""
    if participants.measurements == "axes":
        return diagnostics.over_axes(ops, columns, participants.group)
    if participants.measurements == "peaks":
        # The statistics policy decides on these two: each takes the largest, alike.
        zero, subnormal, near, peak = columns
        group = participants.group
        return zero, subnormal, ops.all_max(near, group), ops.all_max(peak, group)
    return columns
