"""The values a loss-scale field may hold when a checkpoint restores it.

A file whose digests were recomputed after an edit passes every check of
the format; what it holds must still be a state the loss-scale step can
have reached. `lossscale.saving.restore` (and `load`) checks each
`LossScaleState` field it is about to write against `RULES` and raises
`CheckpointError`, before anything is written, for a scale that is not a
finite number > 0 (a NaN scale would skip every step), a negative counter
and the like.
"""

import dataclasses
import math

import numpy as np

from lossscale.mixed_precision.state import (
    MAX_HISTORY_LENGTH,
    NO_ERROR,
    TOO_MANY_SKIPS,
    LossScaleState,
)

# field -> (accepts(value), what is accepted). `nonfinite` is a boolean:
# every value is one it can hold.
RULES = {
    "scale": (lambda x: math.isfinite(x) and x > 0, "a finite number > 0"),
    "counter": (lambda x: x >= 0, "an integer >= 0"),
    "consecutive_skips": (lambda x: x >= 0, "an integer >= 0"),
    "steps": (lambda x: x >= 0, "an integer >= 0"),
    "skipped": (lambda x: x >= 0, "an integer >= 0"),
    "last_overflow_step": (lambda x: x >= -1, "an integer >= -1"),
    "scale_history": (
        lambda x: math.isfinite(x) and x >= 0,
        "a finite number >= 0 (0 before the first step)",
    ),
    "error": (
        lambda x: NO_ERROR <= x <= TOO_MANY_SKIPS,
        f"one of {NO_ERROR}, ..., {TOO_MANY_SKIPS}",
    ),
    "error_step": (lambda x: x >= -1, "an integer >= -1"),
    "loss_finite": (lambda x: x in (-1, 0, 1), "-1 (not recorded), 0 or 1"),
    "overflow_steps": (lambda x: x >= -1, "an integer >= -1"),
    "overflow_loss": (lambda x: x in (-1, 0, 1), "-1 (not recorded), 0 or 1"),
    "overflow_bits": (lambda x: 0 <= x < 2**MAX_HISTORY_LENGTH, "an integer in [0, 2**30)"),
    "range_zero": (lambda x: 0 <= x <= 1, "a share in [0, 1]"),
    "range_subnormal": (lambda x: 0 <= x <= 1, "a share in [0, 1]"),
    "range_near_max": (lambda x: 0 <= x <= 1, "a share in [0, 1]"),
    # A gradient's largest magnitude: inf or NaN where it held one.
    "range_max_abs": (lambda x: not x < 0, "a magnitude >= 0 (inf or NaN allowed)"),
    "range_step": (lambda x: x >= -1, "an integer >= -1"),
}

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


def problem(field, name, array):
    """What is wrong with `array`, saved as `name`, as field `field`'s value; None if valid."""
    rule = RULES.get(field)
    if rule is None:
        return None
    accepts, accepted = rule
    # A vector field (`range_zero`) holds an entry per model variable.
    refused = [x for x in np.asarray(array).ravel().tolist() if not accepts(x)]
    if not refused:
        return None
    value = refused[0]
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
