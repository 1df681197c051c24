"""The values a loss-scale field may hold when state comes back in: one validation.

A file whose digests were recomputed after an edit passes every check of
the format, and a `load_state_dict`, a `.keras` file or a pytree restored
by orbax can hold anything; what comes back must still be a state the
loss-scale step can have reached. Every way in (`lossscale.saving`,
`load_state_dict` of `LossScaleOptimizer`, `lossscale.torch.Optimizer` and
`GradScaler`, the Keras socket's `load_own_variables`,
`lossscale.optax.check`, `Transform.check`) checks each field against
`rule(field, policy)` before anything is written: a scale that is not a
normal float32 within the policy's bounds (a NaN scale would skip every
step, a 0 would pin it at the floor), a counter that is negative or not a
whole number (3.7 would be truncated), a step count below 0 (the next step
would write NaN into every weight), and the like.
"""

import dataclasses
import math

import numpy as np

from lossscale.mixed_precision.policy import MAX_SCALE, MIN_SCALE
from lossscale.mixed_precision.state import (
    CAUSES,
    MAX_HISTORY_LENGTH,
    NO_ERROR,
    TOO_MANY_SKIPS,
    LossScaleState,
)


def _whole(low, high=math.inf):
    """A rule for a whole number in [low, high]."""
    accepted = f"an integer >= {low}" if high == math.inf else f"an integer in [{low}, {high}]"
    return (lambda x: low <= x <= high and math.isfinite(x) and x == math.floor(x)), accepted


def _share():
    return (lambda x: 0 <= x <= 1), "a share in [0, 1]"


# field -> (accepts(value), what is accepted), the policy aside (see `rule`).
# `nonfinite` is a boolean: every value is one it can hold. `iteration` is
# an optimizer's own step count, beside the loss-scale fields.
RULES = {
    "scale": (
        lambda x: MIN_SCALE <= x <= MAX_SCALE,
        f"a normal float32 number > 0 (from {MIN_SCALE:g} to {MAX_SCALE:g})",
    ),
    "counter": _whole(0),
    "consecutive_skips": _whole(0),
    "steps": _whole(0),
    "skipped": _whole(0),
    "last_overflow_step": _whole(-1),
    "scale_history": (
        lambda x: math.isfinite(x) and x >= 0,
        "a finite number >= 0 (0 before the first step)",
    ),
    "error": _whole(NO_ERROR, TOO_MANY_SKIPS),
    "error_step": _whole(-1),
    "streak_scale": (lambda x: math.isfinite(x) and x >= 0, "a finite number >= 0"),
    "persistent_step": _whole(-1),
    "loss_finite": _whole(-1, 1),
    "overflow_steps": _whole(-1),
    "overflow_loss": _whole(-1, 1),
    "overflow_cause": _whole(-1, max(CAUSES)),
    "overflow_bits": _whole(0, 2**MAX_HISTORY_LENGTH - 1),
    "range_zero": _share(),
    "range_subnormal": _share(),
    "range_near_max": _share(),
    # A gradient's largest magnitude: inf or NaN where it held one.
    "range_max_abs": (lambda x: not x < 0, "a magnitude >= 0 (inf or NaN allowed)"),
    "range_step": _whole(-1),
    "iteration": _whole(0),
}


def rule(field, policy=None):
    """`(accepts(value), what is accepted)` of `field`, within `policy`'s bounds where given."""
    accepts, accepted = RULES[field]
    if field != "scale" or policy is None:
        return accepts, accepted
    low = MIN_SCALE if policy.min_scale is None else max(MIN_SCALE, policy.min_scale)
    high = MAX_SCALE if policy.max_scale is None else policy.max_scale
    if (low, high) == (MIN_SCALE, MAX_SCALE):
        return accepts, accepted
    return (lambda x: low <= x <= high), f"a float32 number from {low:g} to {high:g}"


def violation(field, array, policy=None):
    """`(value, what is accepted)` of the first entry of `array` `field` cannot hold, or None.

    Args:
        field: A `LossScaleState` field's name, or `"iteration"`.
        array: Its value (a number, or an array of any backend read to NumPy
            first; a vector field holds an entry per model variable).
        policy: The `LossScalePolicy` whose bounds the scale must keep, or None.
    """
    if field not in RULES:
        return None
    accepts, accepted = rule(field, policy)
    values = np.asarray(array).ravel()
    if values.dtype == np.bool_:
        return None
    whole = values.dtype.kind in "iu"  # shown as the integers they are
    for x in values.astype(np.float64).tolist():
        if not accepts(x):
            return (int(x) if whole else x), accepted
    return None


def refusal(field, where, array, policy=None, after="Nothing was loaded."):
    """The message refusing `array` as `field`'s value at `where`, or None where it may hold it."""
    found = violation(field, array, policy)
    if found is None:
        return None
    value, accepted = found
    what = "the optimizer's step count" if field == "iteration" else f"the loss scale's `{field}`"
    return f"`{where}` holds {value!r}, but {what} must be {accepted}. {after}"


# A wrapper's variable name -> its field (`dynamic_scale` -> `scale`); a
# vector field's one variable has the field's name.
_BY_VARIABLE = {
    f.metadata["variable"] or f.name: f.name
    for f in dataclasses.fields(LossScaleState)
    if f.metadata["per"] in ("step", "vector")
}


_HISTORIES = tuple(
    f.name for f in dataclasses.fields(LossScaleState) if f.metadata["per"] == "history"
)
_PER_VARIABLE = tuple(
    f.name
    for f in dataclasses.fields(LossScaleState)
    if f.metadata["per"] == "variable" and f.name in RULES
)


def problem(field, name, array, policy=None):
    """What is wrong with `array`, saved as `name`, as field `field`'s value; None if valid."""
    found = violation(field, array, policy)
    if found is None:
        return None
    value, accepted = found
    return (
        f"{name!r} holds {value!r}, but the loss scale's `{field}` must be {accepted}; the "
        "file was changed after it was saved. Nothing was restored"
    )


def variable_fields(variable_names):
    """`{variable name: field}` for the variables a `LossScaleOptimizer` makes.

    Args:
        variable_names: The names (last path component) of the wrapper's own
            variables, such as `dynamic_scale`, `step_counter`,
            `scale_history_3`, `dense_kernel_nonfinite`.
    """
    fields = {}
    for name in variable_names:
        if name in _BY_VARIABLE:
            fields[name] = _BY_VARIABLE[name]
            continue
        for history in _HISTORIES:
            if name.startswith(history + "_") and name.removeprefix(history + "_").isdigit():
                fields[name] = history
        for per_variable in _PER_VARIABLE:
            if name.endswith("_" + per_variable):
                fields[name] = per_variable
    return fields


def key_path_field(suffix):
    """The field a key path below a `DynamicLossScaleState` names (`.scale_history[3]`)."""
    name = suffix.removeprefix(".").split("[")[0]
    return name if name in RULES else None
