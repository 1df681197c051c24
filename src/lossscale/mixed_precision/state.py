"""`LossScaleState`: the loss-scale state, and the fields a policy may track.

Each field carries its metadata (when it exists, its dtype, its initial
value, its variable's name, whether it is one scalar, a history or one per
model variable); `LossScalePolicy.tracks` reads the group, the wrapper
creates variables from the rest. Derived field lists are computed here
once, never written by hand.
"""

import dataclasses

# Scales kept in `LossScaleState.scale_history` (used by the error message).
HISTORY_LENGTH = 8

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
        per: `"step"` for a scalar, `"history"` for `HISTORY_LENGTH`
            scalars, `"variable"` for one scalar per model variable.
    """
    return dataclasses.field(
        default=None if per == "step" else (),
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
        steps: Int. Steps taken, skipped or not.
        skipped: Int. Skipped steps in total.
        last_overflow_step: Int. Index (from 0) of the last skipped step, or -1.
        error: Int. `NO_ERROR`, `BELOW_MIN_SCALE` or `TOO_MANY_SKIPS`. Once
            set, the state no longer changes and no step is applied.
        error_step: Int. Index of the step that set `error`, or -1.
        scale_history: The scales used by the last `HISTORY_LENGTH` steps,
            oldest first (entries before the first step are 0).
        nonfinite: One boolean per model variable (in build order): whether
            its gradient was non-finite at the last overflow.
    """

    scale: object = _state("keras", "float32", None, "dynamic_scale")
    counter: object = _state("keras", "int32", 0, "step_counter")
    consecutive_skips: object = _state("streak", "int32", 0)
    steps: object = _state("telemetry", "int32", 0)
    skipped: object = _state("telemetry", "int32", 0, "skipped_steps")
    last_overflow_step: object = _state("telemetry", "int32", -1)
    scale_history: tuple = _state("telemetry", "float32", 0.0, per="history")
    nonfinite: tuple = _state("telemetry", "bool", False, per="variable")
    error: object = _state("fail_fast", "int32", NO_ERROR)
    error_step: object = _state("fail_fast", "int32", -1)


_STATE_FIELDS = dataclasses.fields(LossScaleState)
_FIELDS = {f.name: f for f in _STATE_FIELDS}
# Every field's name, in declaration order.
STATE_FIELD_NAMES = tuple(_FIELDS)


def replaced(state, **changes):
    """`state` with some fields changed (`dataclasses.replace`, traceable by torch.compile)."""
    return LossScaleState(**{n: changes.get(n, getattr(state, n)) for n in STATE_FIELD_NAMES})
