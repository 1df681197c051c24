"""`LossScaleState`: the loss-scale state, and the fields a policy may track.

Each field carries its metadata (when it exists, its dtype, its initial
value, its variable's name, whether it is one scalar, a history or one per
model variable); `LossScalePolicy.tracks` reads the group, the wrapper
creates variables from the rest. Derived field lists are computed here
once, never written by hand.
"""

import dataclasses

# Entries kept in each history field (`LossScaleState.scale_history`, the
# overflow window) unless `LossScalePolicy.history_length` says otherwise.
HISTORY_LENGTH = 8
# The longest window: `overflow_bits` keeps one bit per overflow in an int32.
MAX_HISTORY_LENGTH = 30

# Values of `LossScaleState.error`.
NO_ERROR = 0
BELOW_MIN_SCALE = 1
TOO_MANY_SKIPS = 2


def _state(group, dtype, initial, variable=None, per="step"):
    """Describes a state field.

    Args:
        group: When the field exists (see `LossScalePolicy.tracks`).
        dtype: Its dtype (integers are int32 on every backend, as in Keras 3).
        initial: Its initial value; `None` means `initial_scale`.
        variable: The optimizer variable's name (defaults to the field's).
        per: `"step"` for a scalar, `"history"` for
            `LossScalePolicy.history_length` scalars, `"variable"` for one
            scalar per model variable, `"vector"` for one array with an
            entry per model variable (one state leaf, however many
            variables: what a jitted step passes in and out).
    """
    return dataclasses.field(
        default=None if per in ("step", "vector") else (),
        metadata=dict(group=group, dtype=dtype, initial=initial, variable=variable, per=per),
    )


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """The loss-scale state: backend scalars, or tuples of them.

    Fields a policy does not track are `None` (tuples: empty).

    Attributes:
        scale: Float32. The current loss scale.
        counter: Int. Consecutive finite steps since the last growth or
            overflow.
        consecutive_skips: Int. Overflowing (skipped) steps in a row.
        steps: Int. Steps taken, skipped or not (kept with telemetry and
            with diagnostics).
        skipped: Int. Skipped steps in total.
        last_overflow_step: Int. Index (from 0) of the last skipped step, or -1.
        error: Int. `NO_ERROR`, `BELOW_MIN_SCALE` or `TOO_MANY_SKIPS`. Once
            set, the state no longer changes and no step is applied.
        error_step: Int. Index of the step that set `error`, or -1.
        scale_history: The scales used by the last `history_length` steps,
            oldest first (entries before the first step are 0).
        nonfinite: One boolean per model variable (in build order): whether
            its gradient was non-finite at the last overflow.
        loss_finite: Int. Whether this step's loss was finite: 1, 0, or -1
            when no `scale_loss` recorded it. Reset to -1 by every step.
        overflow_steps: The steps of the last `history_length` overflows,
            oldest first (-1: no overflow there yet).
        overflow_loss: For each of those overflows, `loss_finite` then.
        overflow_bits: One int per model variable: bit k is set when its
            gradient was non-finite at the k-th most recent overflow of the
            window (bit 0: the last one).
        range_zero: A float32 vector, one entry per model variable: the
            share of its scaled gradient's elements that were 0 at the last
            measurement. (A holder whose variables are not known in advance,
            `GradScaler`, lends the four `range_*` fields as tuples of
            scalars instead; `next_loss_scale` reads either.)
        range_subnormal: The share that was a float16 subnormal
            (0 < |g| < 2^-14): precision already lost.
        range_near_max: The share at or above `FLOAT16_MAX / growth_factor`:
            the next growth would overflow them.
        range_max_abs: The largest magnitude.
        range_step: Int. The step of the last measurement, or -1.
    """

    scale: object = _state("keras", "float32", None, "dynamic_scale")
    counter: object = _state("keras", "int32", 0, "step_counter")
    consecutive_skips: object = _state("streak", "int32", 0)
    steps: object = _state("steps", "int32", 0)
    skipped: object = _state("telemetry", "int32", 0, "skipped_steps")
    last_overflow_step: object = _state("telemetry", "int32", -1)
    scale_history: tuple = _state("telemetry", "float32", 0.0, per="history")
    nonfinite: tuple = _state("telemetry", "bool", False, per="variable")
    error: object = _state("fail_fast", "int32", NO_ERROR)
    error_step: object = _state("fail_fast", "int32", -1)
    loss_finite: object = _state("telemetry", "int32", -1)
    overflow_steps: tuple = _state("telemetry", "int32", -1, per="history")
    overflow_loss: tuple = _state("telemetry", "int32", -1, per="history")
    overflow_bits: tuple = _state("telemetry", "int32", 0, per="variable")
    range_zero: object = _state("diagnostics", "float32", 0.0, per="vector")
    range_subnormal: object = _state("diagnostics", "float32", 0.0, per="vector")
    range_near_max: object = _state("diagnostics", "float32", 0.0, per="vector")
    range_max_abs: object = _state("diagnostics", "float32", 0.0, per="vector")
    range_step: object = _state("diagnostics", "int32", -1)


_STATE_FIELDS = dataclasses.fields(LossScaleState)
_FIELDS = {f.name: f for f in _STATE_FIELDS}
# Every field's name, in declaration order.
STATE_FIELD_NAMES = tuple(_FIELDS)


def per_variable(field) -> bool:
    """Whether `field` (a `dataclasses.Field` of `LossScaleState`) has an entry per variable."""
    return field.metadata["per"] in ("variable", "vector")


def replaced(state, **changes):
    """`state` with some fields changed (`dataclasses.replace`, traceable by torch.compile).

    Raises:
        TypeError: a name in `changes` is not a field (as `dataclasses.replace`).
    """
    unknown = sorted(set(changes) - set(STATE_FIELD_NAMES))
    if unknown:
        raise TypeError(
            f"`replaced` got unknown `LossScaleState` fields: {unknown}. "
            f"Expected names among: {list(STATE_FIELD_NAMES)}."
        )
    return LossScaleState(**{n: changes.get(n, getattr(state, n)) for n in STATE_FIELD_NAMES})
