"""The dynamic loss-scale state machine: one pure function, every backend.

`next_loss_scale(ops, state, finite, policy)` returns the new
`LossScaleState` with selects, never Python branches on array values (only
on the static `LossScalePolicy`), so every front end and `jax.jit` share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lossscale.mixed_precision.policy import (  # noqa: F401 - re-exported
    FLOAT16_MAX,
    HEADROOM_MARGIN,
    MIN_SCALE,
    LossScalePolicy,
    state_fields,
)
from lossscale.mixed_precision.state import (  # noqa: F401 - re-exported
    BELOW_MIN_SCALE,
    CAUSES,
    NO_ERROR,
    NONFINITE_LOSS,
    OVERFLOW,
    PERSISTENT,
    PERSISTENT_DROP,
    TOO_MANY_SKIPS,
    LossScaleState,
    replaced,
)
from lossscale.typing import Array

if TYPE_CHECKING:
    from lossscale.backends.protocol import BackendOps


def may_apply(
    ops: BackendOps, state: LossScaleState, finite: Array, policy: LossScalePolicy
) -> Array:
    """Whether this step's gradients are applied: finite, and no error recorded."""
    if not policy.fails_fast:
        return finite
    return ops.logical_and(finite, state.error == NO_ERROR)


def _zero(x):
    # Made on the device: converting a Python number would cost a host-to-device copy.
    return x * 0


def _constant(ops, value, dtype, like):
    return ops.full((), value, dtype, like=like)


def next_loss_scale(
    ops: BackendOps,
    state: LossScaleState,
    finite: Array,
    policy: LossScalePolicy,
    peak: Array | None = None,
    variable_finite: Sequence[Array | None] = (),
    skip: Array | None = None,
    in_place: bool = False,
    measured: Array | bool | None = None,
    scale_at_least: float = 0.0,
) -> LossScaleState:
    """Advances the loss-scale state by one step.

    With finite gradients the counter increments; on the
    `dynamic_growth_steps`-th finite step in a row the scale grows by
    `growth_factor` and the counter resets (not past float32's range or
    `max_scale`; with `growth_policy="headroom"` not where `peak *
    growth_factor` would reach `FLOAT16_MAX / HEADROOM_MARGIN`). With
    non-finite gradients the counter resets and, once `hysteresis` steps in
    a row have overflowed, the scale backs off by `backoff_factor`, never
    below `MIN_SCALE`; a backoff below `min_scale`, or more than
    `max_consecutive_skips` skips in a row, records an error instead, after
    which the state stays as it is. With telemetry an overflow also enters
    the overflow window. Tracked fields that are `None` in `state` start
    from their initial values.

    Args:
        ops: The backend module of the state's arrays.
        state: The current `LossScaleState`.
        finite: Backend boolean scalar, whether every gradient was finite.
        policy: The `LossScalePolicy`.
        peak: Float32 scalar, the largest magnitude of the (scaled)
            gradients; required with `growth_policy="headroom"`.
        variable_finite: For each entry of `state.nonfinite`, a boolean
            scalar (whether that variable's gradient was finite) or `None`
            (it had no gradient this step).
        skip: Optional float32 scalar, 1.0 where `finite` is False (torch's
            AMP form, which a backend kernel reads instead).
        in_place: Whether the arrays of `state` may be overwritten with the
            new state. Defaults to False.
        measured: With `diagnostics_every`: whether the `range_*` fields of
            `state` hold this step's measurement (a boolean scalar or a
            Python bool). `None`: not measured.
        scale_at_least: A lower bound of `state.scale` known on the host
            (`scale_lower_bound`), or 0.0: a plain policy's kernel leaves
            out the floor where a backoff cannot reach it.

    Returns:
        The next `LossScaleState`.
    """
    if policy.growth_policy == "headroom" and peak is None:
        raise ValueError('`peak` is required with growth_policy="headroom". Received: peak=None')
    if len(variable_finite) != len(state.nonfinite):
        raise ValueError(
            "`variable_finite` must hold one entry per entry of `state.nonfinite` "
            f"({len(state.nonfinite)}). Received: {len(variable_finite)} entries"
        )
    state = _complete(ops, state, policy)
    if policy.is_plain and ops.fused_scale_update() is not None:
        scale, counter = plain_update(
            ops,
            state.scale,
            state.counter,
            finite,
            policy,
            skip=skip,
            in_place=in_place,
            scale_at_least=scale_at_least,
        )
        counted = _counted(ops, state, policy, measured, in_place=in_place and ops.MUTABLE)
        return replaced(state, scale=scale, counter=counter, **counted)
    scale, counter = state.scale, state.counter
    overflow = ops.logical_not(finite)
    new = {}

    statistics = policy.growth_policy == "statistics"
    if statistics:
        grow, early = _statistics_decision(ops, state, finite, policy, measured)
    else:
        grow = ops.logical_and(finite, counter == policy.dynamic_growth_steps - 1)
    with ops.quiet():  # an overflowing candidate is computed on purpose
        grown = scale * policy.growth_factor
        if policy.max_scale is not None:
            grown = ops.minimum(grown, _constant(ops, policy.max_scale, "float32", scale))
        else:
            grown = ops.where(ops.isfinite(grown), grown, scale)
        if policy.growth_policy == "headroom":
            room = peak * policy.growth_factor < FLOAT16_MAX / HEADROOM_MARGIN
            grown = ops.where(room, grown, scale)
        backed_off = scale * policy.backoff_factor
    if policy.min_scale is None:
        backed_off = ops.maximum(backed_off, _constant(ops, MIN_SCALE, "float32", scale))
    else:  # not taken: the step is recorded as failed below
        below = backed_off < policy.min_scale
        backed_off = ops.where(below, scale, backed_off)

    if policy.tracks("consecutive_skips"):
        streak = ops.where(finite, _zero(counter), state.consecutive_skips + 1)
        new["consecutive_skips"] = streak
        back_off = ops.logical_and(overflow, streak >= policy.hysteresis)
    else:
        back_off = overflow
    overflow_back_off = back_off
    if statistics:  # a finite step may back off too: before the overflow
        back_off = _either(ops, back_off, early)
    new["scale"] = ops.cast(
        ops.where(grow, grown, ops.where(back_off, backed_off, scale)), "float32"
    )
    counts = ops.logical_and(finite, ops.logical_not(grow))
    if statistics:
        counts = ops.logical_and(counts, ops.logical_not(early))
    new["counter"] = ops.where(counts, counter + 1, _zero(counter))

    step = state.steps
    new.update(_counted(ops, state, policy, measured))
    vectors = {}  # per-variable fields, one vector each: a few ops for any model
    if policy.records_details:
        new["skipped"] = ops.where(finite, state.skipped, state.skipped + 1)
        new["last_overflow_step"] = ops.where(finite, state.last_overflow_step, step)
        new["scale_history"] = state.scale_history[1:] + (scale,)
        bad_now = _bad_now(ops, variable_finite, finite)
        bad_before = ops.stack(state.nonfinite) if bad_now is not None else None
        persistent = _persistent(ops, state, overflow, bad_now, bad_before)
        new["streak_scale"] = ops.where(
            finite,
            _zero(scale),
            ops.where(state.consecutive_skips == 0, scale, state.streak_scale),
        )
        first = ops.logical_and(persistent, state.persistent_step < 0)
        new["persistent_step"] = ops.where(first, step, state.persistent_step)
        cause = ops.where(
            persistent,
            _zero(step) + PERSISTENT,
            ops.where(state.loss_finite == 0, _zero(step) + NONFINITE_LOSS, _zero(step) + OVERFLOW),
        )
        new.update(_overflow_window(ops, state, overflow, step, cause))
        if bad_now is not None:
            bits = ops.stack(state.overflow_bits)
            # The field's own dtype: Keras keeps int fields as int64 on TensorFlow.
            shifted = (
                bits * 2 + ops.cast(bad_now, ops.dtype_name(bits))
            ) % 2**policy.history_length
            vectors["nonfinite"] = (bad_before, ops.where(finite, bad_before, bad_now))
            vectors["overflow_bits"] = (bits, ops.where(overflow, shifted, bits))

    if policy.fails_fast:
        # Only an overflow's backoff fails: an early one below `min_scale` is not taken.
        failed = ops.logical_and(overflow_back_off, below) if policy.min_scale is not None else None
        too_many = (
            streak > policy.max_consecutive_skips
            if policy.max_consecutive_skips is not None
            else None
        )
        code = _zero(state.error)
        if too_many is not None:
            code = ops.where(too_many, code + TOO_MANY_SKIPS, code)
        if failed is not None:
            code = ops.where(failed, _zero(code) + BELOW_MIN_SCALE, code)
        new["error"] = code
        new["error_step"] = ops.where(code != NO_ERROR, step, state.error_step)
        # Once an error is recorded nothing moves, until the host reads it.
        frozen = state.error != NO_ERROR
        new = {
            name: _select(ops, frozen, getattr(state, name), value) for name, value in new.items()
        }
        vectors = {name: (old, ops.where(frozen, old, v)) for name, (old, v) in vectors.items()}
    new.update({name: ops.unstack(v) for name, (_, v) in vectors.items()})
    return replaced(state, **new)


def plain_update(
    ops: BackendOps,
    scale: Array,
    counter: Array,
    finite: Array | None,
    policy: LossScalePolicy,
    *,
    skip: Array | None = None,
    in_place: bool = False,
    scale_at_least: float = 0.0,
) -> tuple[Array, Array]:
    """`(scale, counter)` after one step of a plain policy (`LossScalePolicy.is_plain`).

    In the backend's `fused_scale_update` kernel where it has one, else
    `next_loss_scale`; `finite` may be None where `skip` (its torch AMP
    form) is given. The other arguments are `next_loss_scale`'s.
    """
    kernel = ops.fused_scale_update()
    if kernel is None:
        if finite is None:
            finite = skip == 0
        new = next_loss_scale(ops, LossScaleState(scale=scale, counter=counter), finite, policy)
        return new.scale, new.counter
    return kernel(
        scale,
        counter,
        finite,
        policy.dynamic_growth_steps,
        policy.growth_factor,
        policy.backoff_factor,
        MIN_SCALE,
        skip=skip,
        in_place=in_place,
        scale_at_least=scale_at_least,
    )


# After an update the scale is at least `backoff_factor` times what it was, up
# to float32 rounding: the host's bound shrinks by this much more to stay one.
BOUND_ROUNDING = 1 - 2.0**-20


def scale_lower_bound(bound: float, policy: LossScalePolicy) -> float:
    """A lower bound of the scale after one update, from one before it, known on the host.

    A front end keeps it instead of reading the scale (a device wait):

    ```
    bound' = bound * backoff_factor * (1 - 2^-20)   # float32 rounding of the product
    bound' = min(bound', max_scale)                  # where the policy caps the scale
    bound' = max(bound', MIN_SCALE)                  # a plain policy at or above its floor
    ```
    """
    new = bound * policy.backoff_factor * BOUND_ROUNDING
    if policy.max_scale is not None:
        new = min(new, policy.max_scale)
    if policy.is_plain and bound >= MIN_SCALE:
        new = max(new, MIN_SCALE)
    return new


def _counted(ops, state, policy, measured, in_place=False):
    """The step count and the step of the last measurement, as tracked.

    With `in_place`, `state.steps` is incremented where it is; on a mutable
    backend the measured step is then a copy of the count.
    """
    new = {}
    step = state.steps
    if policy.diagnoses and measured is not None and measured is not False:
        new["range_step"] = (
            (ops.copy(step) if ops.MUTABLE else step)
            if measured is True
            else ops.where(measured, step, state.range_step)
        )
    if policy.tracks("steps"):
        new["steps"] = ops.assign_add(step, 1) if in_place else step + 1
    return new


def _statistics_decision(ops, state, finite, policy, measured):
    """`(grow, back_off_early)` of `growth_policy="statistics"`: both False unless measured."""
    false = state.counter < 0  # a device False, shaped like the flags
    if measured is None or measured is False:
        return false, false
    near = _largest(ops, state.range_near_max, state.scale)
    peak = _largest(ops, state.range_max_abs, state.scale)
    on = finite if measured is True else ops.logical_and(finite, measured)
    with ops.quiet():  # a NaN peak compares False: no growth
        room = peak * policy.growth_factor < FLOAT16_MAX / HEADROOM_MARGIN
    early = ops.logical_and(on, near > 0)
    grow = ops.logical_and(ops.logical_and(on, room), ops.logical_not(early))
    return grow, early


def _either(ops, x, y):
    return ops.logical_not(ops.logical_and(ops.logical_not(x), ops.logical_not(y)))


def _largest(ops, values, like):
    """The largest of `values` (a vector or a tuple of scalars), at least 0; NaN propagates."""
    out = like * 0
    if not isinstance(values, tuple):
        if ops.shape(values) == (0,):
            return out
        return ops.maximum(out, ops.max_abs([values]))  # the entries are >= 0 or NaN
    for v in values:
        out = ops.maximum(out, v)
    return out


def _bad_now(ops, variable_finite, finite):
    """Whether each variable's gradient is non-finite now, one vector; None for no variable.

    A variable without a gradient (None) counts as finite.
    """
    if not variable_finite:
        return None
    true = finite == finite  # a device True: a Python one would be a host-to-device copy
    return ops.logical_not(ops.stack([true if ok is None else ok for ok in variable_finite]))


def _persistent(ops, state, overflow, bad_now, bad_before):
    """Whether this skip is persistent: no back-off can clear it.

    The step before was skipped too, the streak's back-offs lowered the
    scale by `PERSISTENT_DROP` (or it is at most 1), and the variables
    non-finite now (some) were all non-finite at the skip before.
    """
    scale = state.scale
    dropped = ops.logical_not(
        ops.logical_and(state.streak_scale < scale * PERSISTENT_DROP, scale > 1)
    )
    condition = ops.logical_and(ops.logical_and(overflow, state.consecutive_skips > 0), dropped)
    if bad_now is None:
        return ops.logical_and(condition, scale < 0)  # no variable known: never
    new_ones = ops.logical_and(bad_now, ops.logical_not(bad_before))
    same = ops.logical_and(
        ops.logical_not(ops.sum(ops.cast(new_ones, "float32")) > 0),
        ops.sum(ops.cast(bad_now, "float32")) > 0,
    )
    return ops.logical_and(condition, same)


def _overflow_window(ops, state, overflow, step, cause):
    """The overflow window's scalar fields after this step: shifted by one entry on an overflow."""
    return {
        "overflow_steps": _shifted(ops, overflow, state.overflow_steps, step),
        "overflow_loss": _shifted(ops, overflow, state.overflow_loss, state.loss_finite),
        "overflow_cause": _shifted(ops, overflow, state.overflow_cause, cause),
        "loss_finite": _zero(state.loss_finite) - 1,
    }


def _shifted(ops, pred, history, value):
    """`history` with `value` appended (oldest dropped) where `pred` holds."""
    return ops.unstack(ops.where(pred, ops.stack(history[1:] + (value,)), ops.stack(history)))


def _select(ops, pred, old, new):
    if isinstance(new, tuple):
        return tuple(ops.where(pred, o, n) for o, n in zip(old, new))
    return ops.where(pred, old, new)


def _complete(ops, state, policy):
    """`state` with every tracked scalar field present (missing ones at their start)."""
    missing = {}
    for name, per, initial in policy._starts:
        value = getattr(state, name)
        present = bool(value) if per == "history" else value is not None
        if per in ("variable", "vector") or present:
            continue  # given, or sized by the caller, who knows the model
        start = _zero(state.scale if isinstance(initial, float) else state.counter) + initial
        missing[name] = (start,) * policy.history_length if per == "history" else start
    return replaced(state, **missing) if missing else state
