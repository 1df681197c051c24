"""The dynamic loss-scale state machine: one pure function, every backend.

`next_loss_scale(ops, state, finite, policy)` returns the new
`LossScaleState`. It uses selects, never Python branches on array values, so
the stateful wrapper, `stateless_apply` and `jax.jit` share it unchanged.
Python branches here look only at the `LossScalePolicy`, which is static.

Which state fields exist depends on the policy (see `LossScalePolicy.tracks`):
the Keras defaults keep exactly Keras's two (`scale`, `counter`); hysteresis,
telemetry and fail-fast limits add the fields they need.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lossscale.mixed_precision.policy import (  # noqa: F401 - re-exported
    FLOAT16_MAX,
    GROWTH_POLICIES,
    HEADROOM_MARGIN,
    MAX_SCALE,
    MIN_SCALE,
    LossScalePolicy,
    state_fields,
)
from lossscale.mixed_precision.state import (  # noqa: F401 - re-exported
    BELOW_MIN_SCALE,
    CAUSES,
    HISTORY_LENGTH,
    NO_ERROR,
    NONFINITE_LOSS,
    OVERFLOW,
    PERSISTENT,
    PERSISTENT_DROP,
    STATE_FIELD_NAMES,
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
    # A zero of `x`'s dtype and device, made on the device: converting a
    # Python number would cost a host-to-device copy on an accelerator.
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
    `dynamic_growth_steps`-th consecutive finite step the scale grows by
    `growth_factor` and the counter resets (a growth that would leave
    float32's finite range is not taken; `max_scale` caps it; with
    `growth_policy="headroom"` it is not taken when `peak * growth_factor`
    would reach `FLOAT16_MAX / HEADROOM_MARGIN`). With non-finite gradients
    the counter resets and, once `hysteresis` steps in a row have
    overflowed, the scale backs off by `backoff_factor`, never below
    `MIN_SCALE`; a backoff below `min_scale`, or more than
    `max_consecutive_skips` skips in a row, records an error instead, after
    which the state stays as it is. With `growth_policy="statistics"` the
    growth is decided at measured steps instead (see `LossScalePolicy`).

    With telemetry, an overflow also enters the overflow window: its step,
    `state.loss_finite` (whether the loss itself was finite) and, per
    variable, a bit of `overflow_bits`; `loss_finite` is reset to -1.

    Fields of `state` that are `None` but tracked by `policy` start from
    their initial values, so a two-field state works with any policy.

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
        skip: Optional float32 scalar, 1.0 where `finite` is False: the same
            flag in torch's AMP form, when the caller has it (a backend
            kernel reads it instead of converting `finite`).
        in_place: Whether the arrays of `state` may be overwritten with the
            new state (a mutable backend's kernel then updates them where
            they are; the returned state holds them). Defaults to False:
            `state` is left as it was.
        measured: With `diagnostics_every`: whether the `range_*` fields of
            `state` hold this step's measurement (a boolean scalar, or a
            Python bool where the caller decided on the host). `None`: not
            measured.
        scale_at_least: A lower bound of `state.scale` known on the host
            (`scale_lower_bound`), or 0.0: lets a plain policy's kernel
            leave out the floor where the bound shows a backoff cannot
            reach it.

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
    if policy.records_details:
        new["skipped"] = ops.where(finite, state.skipped, state.skipped + 1)
        new["last_overflow_step"] = ops.where(finite, state.last_overflow_step, step)
        new["scale_history"] = state.scale_history[1:] + (scale,)
        new["nonfinite"] = tuple(
            ops.logical_and(old, finite)
            if ok is None
            else ops.where(finite, old, ops.logical_not(ok))
            for old, ok in zip(state.nonfinite, variable_finite)
        )
        persistent = _persistent(ops, state, overflow, variable_finite)
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
        new.update(_overflow_window(ops, state, overflow, step, variable_finite, cause, policy))

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
        # Once an error is recorded, nothing moves: the state keeps
        # describing the failure until the host reads it.
        frozen = state.error != NO_ERROR
        new = {
            name: _select(ops, frozen, getattr(state, name), value) for name, value in new.items()
        }
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

    Keras's rule with the two guards, in the backend's kernel where it has
    one (torch's `_amp_update_scale_`, `fused_scale_update`), else the
    generic selects of `next_loss_scale`. A front end that keeps nothing
    but the scale and the counter calls it directly (`GradScaler` between
    measurements); `next_loss_scale` calls it for a plain policy.

    Args:
        ops: The backend module.
        scale, counter: The state's two arrays.
        finite: Boolean scalar, whether every gradient was finite; may be
            None where `skip` is given.
        policy: A plain `LossScalePolicy`.
        skip: Optional float32 scalar, 1.0 where the step overflowed
            (torch's AMP form of `not finite`).
        in_place: Whether `scale` and `counter` may be updated where they are.
        scale_at_least: A lower bound of `scale` known on the host
            (`scale_lower_bound`), or 0.0.
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


# After an update the scale is at least `backoff_factor` times what it was,
# up to float32 rounding (of the factor and of the product): the host's
# bound shrinks by this much more, so that it stays a lower bound.
BOUND_ROUNDING = 1 - 2.0**-20


def scale_lower_bound(bound: float, policy: LossScalePolicy) -> float:
    """A lower bound of the scale after one update, from one before it, known on the host.

    A front end that decides on the host (whether unscaling may overflow,
    whether the plain update needs its floor) keeps this bound instead of
    reading the scale, which would wait for the device every step:

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

    With `in_place`, `state.steps` is incremented where it is (one operation
    a step, not two): the caller reads it no more. On a mutable backend the
    measured step is a copy of the count, which the caller (or this
    function) writes in place.
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
    """The largest of `values` (a vector, or a tuple of scalars), at least 0 of `like`'s dtype.

    NaN, where one is, propagates (as `maximum` does).
    """
    out = like * 0
    if not isinstance(values, tuple):
        if ops.shape(values) == (0,):
            return out
        return ops.maximum(out, ops.max_abs([values]))  # the entries are >= 0 or NaN
    for v in values:
        out = ops.maximum(out, v)
    return out


def _persistent(ops, state, overflow, variable_finite):
    """Whether this skip is persistent: no back-off can clear it.

    The step before was skipped too, back-offs since the streak began have
    lowered the scale by `PERSISTENT_DROP` (or it is at most 1), and every
    variable non-finite now was non-finite at the skip before (and some is).
    """
    scale = state.scale
    dropped = ops.logical_not(
        ops.logical_and(state.streak_scale < scale * PERSISTENT_DROP, scale > 1)
    )
    condition = ops.logical_and(ops.logical_and(overflow, state.consecutive_skips > 0), dropped)
    flags = [(ok, old) for ok, old in zip(variable_finite, state.nonfinite) if ok is not None]
    if not flags:
        return ops.logical_and(condition, scale < 0)  # no variable known: never
    bad_now = ops.logical_not(ops.stack([ok for ok, _ in flags]))
    bad_before = ops.stack([old for _, old in flags])
    # Every variable bad now was bad before (none new), and some is.
    new_ones = ops.logical_and(bad_now, ops.logical_not(bad_before))
    same = ops.logical_and(
        ops.logical_not(ops.max_abs([ops.cast(new_ones, "float32")]) > 0),
        ops.max_abs([ops.cast(bad_now, "float32")]) > 0,
    )
    return ops.logical_and(condition, same)


def _overflow_window(ops, state, overflow, step, variable_finite, cause, policy):
    """The overflow window's fields after this step: shifted by one entry on an overflow."""
    new = {
        "overflow_steps": _shifted(ops, overflow, state.overflow_steps, step),
        "overflow_loss": _shifted(ops, overflow, state.overflow_loss, state.loss_finite),
        "overflow_cause": _shifted(ops, overflow, state.overflow_cause, cause),
        "loss_finite": _zero(state.loss_finite) - 1,
    }
    wrap = 2**policy.history_length
    bits = []
    for old, ok in zip(state.overflow_bits, variable_finite):
        # In the field's own dtype: Keras keeps int fields as int64 on TensorFlow.
        bad = 0 if ok is None else ops.cast(ops.logical_not(ok), ops.dtype_name(old))
        bits.append(ops.where(overflow, (old * 2 + bad) % wrap, old))
    new["overflow_bits"] = tuple(bits)
    return new


def _shifted(ops, pred, history, value):
    """`history` with `value` appended (oldest dropped) where `pred` holds."""
    moved = history[1:] + (value,)
    return tuple(ops.where(pred, m, h) for m, h in zip(moved, history))


def _select(ops, pred, old, new):
    if isinstance(new, tuple):
        return tuple(ops.where(pred, o, n) for o, n in zip(old, new))
    return ops.where(pred, old, new)


def _complete(ops, state, policy):
    """`state` with every tracked scalar field present (missing ones at their start)."""
    missing = {}
    for name, per, initial in policy._starts:
        if per in ("variable", "vector"):
            continue  # sized by the caller, who knows the model
        if per == "history":
            if not getattr(state, name):
                like = state.scale if isinstance(initial, float) else state.counter
                missing[name] = (_zero(like) + initial,) * policy.history_length
        elif getattr(state, name) is None:
            like = state.scale if isinstance(initial, float) else state.counter
            missing[name] = _zero(like) + initial
    return replaced(state, **missing) if missing else state
