"""The float16 range of a gradient, measured on its device, and its reading on the host.

`measure(ops, grad, growth_factor)` reduces one scaled gradient to four
float32 scalars:

```
a = |float32(grad)|
zero      = mean(a == 0)                           # nothing left to scale
subnormal = mean(0 < a < 2^-14)                    # float16 subnormal: precision lost
near_max  = mean(a >= FLOAT16_MAX / growth_factor) # the next growth overflows them
max_abs   = max(a)                                 # inf or NaN where an element is
```

The shares count elements exactly (an integer count, then one division by
the size), so they equal a float64 count of the same values to float32's
precision. NaN counts in no share; inf counts as near the maximum.

`measure_into` measures many gradients into state variables, through the
backend's `fused_float16_range` kernel where it has one (the same values,
bit for bit, in a fixed number of operations).

A step measures only when its policy says (`diagnostics_every`); the
results are optimizer state, read on the host by `summary()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from lossscale.typing import Array

if TYPE_CHECKING:
    from lossscale.backends.protocol import BackendOps

FLOAT16_MAX = float(np.finfo(np.float16).max)
# The smallest normal float16: below it (and above 0) a float16 is subnormal.
FLOAT16_SMALLEST_NORMAL = float(np.finfo(np.float16).smallest_normal)
# The keys of one variable's entry of `summary()["float16_range"]`, in the
# order of `measure`'s results and of the `range_*` state fields.
KEYS = ("zero", "subnormal", "near_max", "max_abs")
FIELDS = ("range_zero", "range_subnormal", "range_near_max", "range_max_abs")


def near_max_limit(growth_factor: float) -> float:
    """The magnitude from which one growth by `growth_factor` overflows float16."""
    return FLOAT16_MAX / growth_factor


def measure(
    ops: BackendOps, grad: Array, growth_factor: float
) -> tuple[Array, Array, Array, Array]:
    """The float16 range of one scaled gradient (see the module docstring).

    Args:
        ops: The gradient's backend module.
        grad: A floating-point array with at least one element.
        growth_factor: The policy's growth factor (for `near_max`).

    Returns:
        `(zero, subnormal, near_max, max_abs)`, float32 backend scalars.
    """
    size = 1
    for n in ops.shape(grad):
        size *= n
    a = ops.abs(ops.cast(grad, "float32"))
    with ops.quiet():  # inf and NaN are measured, not warned about
        zero = ops.sum(ops.cast(a == 0, "int32"))
        below = ops.sum(ops.cast(a < FLOAT16_SMALLEST_NORMAL, "int32"))
        near = ops.sum(ops.cast(a >= near_max_limit(growth_factor), "int32"))
        shares = [ops.cast(count, "float32") / float(size) for count in (zero, below - zero, near)]
    return (*shares, ops.cast(ops.max_abs([grad]), "float32"))


def measure_into(
    ops: BackendOps, grads: list[Array], growth_factor: float, fields: list[list]
) -> None:
    """Measures each of `grads` (as `measure`) into its `Variable` of each of `fields`.

    Args:
        ops: The gradients' backend module.
        grads: Floating-point arrays, each with at least one element.
        growth_factor: The policy's growth factor (for `near_max`).
        fields: `(zero, subnormal, near_max, max_abs)` lists of float32
            scalar `Variable`s, one per gradient, assigned the results.
    """
    kernel = ops.fused_float16_range()
    if kernel is not None:
        # A mutable backend's variables hold their arrays: written in place.
        out = [[v.value for v in field] for field in fields]
        if kernel(grads, FLOAT16_SMALLEST_NORMAL, near_max_limit(growth_factor), out):
            return
    for i, grad in enumerate(grads):
        for field, value in zip(fields, measure(ops, grad, growth_factor)):
            field[i].assign(value)


def due(policy, steps: Array) -> Array:
    """Whether the step numbered `steps` (from 0) is measured, as a device boolean."""
    return steps % policy.diagnostics_every == 0


def float16_range(values: dict, names: list[str]) -> dict[str, dict[str, float]]:
    """`{name: {"zero", "subnormal", "near_max", "max_abs"}}` from the host values of the fields.

    Args:
        values: `{field name: list of NumPy scalars}` holding `FIELDS`.
        names: The variable names, in the order of those lists.
    """
    columns = [values[f] for f in FIELDS]
    return {
        name: {key: float(column[i]) for key, column in zip(KEYS, columns)}
        for i, name in enumerate(names)
    }
