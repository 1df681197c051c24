"""The float16 range of a gradient, measured on its device, and its reading on the host.

`measure(ops, grad, growth_factor)` reduces one scaled gradient to four
float32 scalars:

```
a = |float32(grad)|
zero      = mean(a == 0)                           # nothing left to scale
subnormal = mean(0 < a < 2^-14)                    # float16 subnormal: precision lost
near_max  = mean(a >= FLOAT16_MAX / growth_factor) # the next growth overflows them
max_abs   = max(a)                                 # NaN where one is, else inf where one is
```

The shares count elements exactly (an integer count, then one division by
the size). NaN counts in no share; inf counts as near the maximum; a NaN
makes `max_abs` NaN, even beside an inf. `measure_all` measures many
gradients into four vectors, through the backend's `fused_float16_range`
kernel where it has one (the same values, bit for bit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from lossscale.typing import Array

if TYPE_CHECKING:
    from lossscale.backends.protocol import BackendOps

FLOAT16_MAX = float(np.finfo(np.float16).max)
FLOAT16_SMALLEST_NORMAL = float(np.finfo(np.float16).smallest_normal)
# One variable's keys in `summary()["float16_range"]`, in `measure`'s order.
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
        # A NaN anywhere (it compares False) makes the peak NaN, in any reduction order.
        numbers = ops.sum(ops.cast(a <= float("inf"), "int32"))
        peak = ops.where(numbers == size, ops.cast(ops.max_abs([grad]), "float32"), float("nan"))
    return (*shares, peak)


def measure_all(
    ops: BackendOps, grads: list[Array], growth_factor: float
) -> tuple[Array, Array, Array, Array]:
    """`measure` of each of non-empty `grads`, as four float32 vectors (entry i: `grads[i]`)."""
    kernel = ops.fused_float16_range()
    if kernel is not None:
        columns = kernel(grads, FLOAT16_SMALLEST_NORMAL, near_max_limit(growth_factor))
        if columns is not None:
            return columns
    rows = [measure(ops, g, growth_factor) for g in grads]
    return tuple(ops.stack(list(column)) for column in zip(*rows))


def measure_at(
    ops: BackendOps,
    grads: list[Array],
    growth_factor: float,
    old: tuple,
    indices: list[int],
) -> tuple:
    """The vectors `old` with entries `indices` replaced by the measurement of `grads`.

    Args:
        ops: The gradients' backend module.
        grads: Non-empty floating-point arrays.
        growth_factor: The policy's growth factor (for `near_max`).
        old: The four float32 vectors, an entry per model variable.
        indices: Each gradient's entry; the others keep their value.
    """
    columns = measure_all(ops, grads, growth_factor)
    (count,) = ops.shape(old[0])
    if list(indices) == list(range(count)):
        return tuple(columns)
    out = []
    for previous, column in zip(old, columns):
        entries = [previous[i] for i in range(count)]
        for j, i in enumerate(indices):
            entries[i] = column[j]
        out.append(ops.stack(entries))
    return tuple(out)


def over_axes(ops: BackendOps, columns: tuple, axis_name: Any) -> tuple:
    """The four vectors each device measured of its blocks, agreed over `axis_name`.

    Shares are the devices' mean (equal blocks: the whole gradient's share),
    peaks the largest, so the state stays replicated.
    """
    zero, subnormal, near, peak = columns
    shares = (ops.all_mean(x, axis_name) for x in (zero, subnormal, near))
    return (*shares, ops.all_max(peak, axis_name))


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
