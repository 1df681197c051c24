"""The values a loss-scale field may hold when state comes back in: one validation.

A loaded file, state dict or restored pytree can hold anything; every way
in checks each field against `rule(field, policy)` before anything is
written, so what comes back is a state the step can have reached (a NaN
scale would skip every step, a negative step count write NaN weights).
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
# `nonfinite` (a boolean) may hold anything; `iteration` is an optimizer's step count.
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

    `field` is a `LossScaleState` field's name or `"iteration"`; `array` a
    number or a NumPy-readable array.
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


# A wrapper's variable name -> its field (`dynamic_scale` -> `scale`).
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
    """`{variable name: field}` of a `LossScaleOptimizer`'s own variables' last path components."""
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
