"""What the loss-scale policy reads of a step's gradients: one measurement for every interface.

```
peaks[i]    = max |g_i|                          # each gradient's largest scaled magnitude
unscaled[i] = cast(peaks[i] / scale, dtype_i)    # dtype_i: what g_i is unscaled to
finite      = all(isfinite(unscaled))            # catches an overflow the unscaling causes
peak        = max(peaks)                         # growth_policy="headroom"
variable_finite[i] = isfinite(unscaled[i])       # telemetry
```

Division and rounding are monotone, so a gradient's peak divided by the
scale, in the dtype it is unscaled to, is its largest unscaled magnitude,
inf or NaN exactly when an unscaled value is: each scaled gradient is read
once, by the reduction that gives its peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class Inspection(NamedTuple):
    """What `next_loss_scale` takes of the gradients.

    Attributes:
        finite: Boolean scalar: whether every unscaled gradient is finite.
        peak: The largest scaled magnitude (float32 scalar) with
            `growth_policy="headroom"`, else None.
        variable_finite: With telemetry, one boolean scalar per peak (None
            where the peak is None); else `()`.
    """

    finite: Any
    peak: Any
    variable_finite: tuple


def inspect(
    ops,
    peaks: Sequence[Any],
    dtypes: Sequence[str | None],
    scale: Any,
    policy,
) -> Inspection:
    """The policy's gradient statistics from the gradients' largest scaled magnitudes.

    Args:
        ops: The backend's operations.
        peaks: Each gradient's (or group's) largest scaled magnitude, a
            float32 scalar; None for an empty gradient.
        dtypes: Per peak, the dtype name its gradient is unscaled to, or
            None for one not unscaled (checked as it is, left out of
            `peak`).
        scale: The loss scale the peaks were measured under.
        policy: The `LossScalePolicy`.

    Returns:
        An `Inspection`.
    """
    like = scale * 0
    groups = {}  # unscaled dtype (None: not unscaled) -> positions of present peaks
    for i, (p, dtype) in enumerate(zip(peaks, dtypes)):
        if p is not None:
            groups.setdefault(dtype, []).append(i)
    flags = [None] * len(peaks)
    checked = []
    with ops.quiet():  # an overflow in the cast is what is being detected
        for dtype, members in groups.items():
            stacked = ops.stack([peaks[i] for i in members])
            values = stacked if dtype is None else ops.cast(stacked / scale, dtype)
            checked.append(values)
            if policy.records_details:
                for i, flag in zip(members, ops.unstack(ops.isfinite(values))):
                    flags[i] = flag
    finite = ops.isfinite(ops.max_abs(checked)) if checked else ops.isfinite(like)
    peak = None
    if policy.growth_policy == "headroom":
        scaled = [
            peaks[i] for dtype, members in groups.items() if dtype is not None for i in members
        ]
        peak = ops.max_abs([ops.stack(scaled)]) if scaled else like
    return Inspection(finite, peak, tuple(flags) if policy.records_details else ())


def gradient_peaks(ops, grads, divided, by_variable):
    """`[(peak, positions)]`: the largest magnitudes of the non-empty scaled `grads`.

    One per gradient when `by_variable`, else one per dtype and kind
    (positions in `divided` or not).
    """
    divided = set(divided)
    groups = {}
    for i, g in enumerate(grads):
        if g is not None and 0 not in ops.shape(g):
            key = i if by_variable else (ops.dtype_name(g), i in divided)
            groups.setdefault(key, []).append(i)
    return [(ops.max_abs([grads[i] for i in at]), at) for at in groups.values()]


def inspect_gradients(ops, peaks, unscaled, scale, policy, variable_of, variable_count):
    """`inspect` of `gradient_peaks(...)`, with the per-variable flags placed by variable.

    `unscaled` is `{position: unscaled gradient}` of the divided ones;
    `variable_finite` (with telemetry) gets `variable_count` entries, placed
    by `variable_of(position)`, None where a variable had no peak.
    """
    dtypes = [ops.dtype_name(unscaled[at[0]]) if at[0] in unscaled else None for _, at in peaks]
    found = inspect(ops, [p for p, _ in peaks], dtypes, scale, policy)
    if not policy.records_details:
        return found
    flags = [None] * variable_count
    for flag, (_, at) in zip(found.variable_finite, peaks):
        flags[variable_of(at[0])] = flag
    return found._replace(variable_finite=tuple(flags))


def agreed_flags(ops, flags: Sequence[Any], group: Any) -> tuple:
    """Each of `flags` (a boolean scalar, or None) held on every participant of `group`.

    One collective (`ops.all_true` of their vector); None entries stay None.
    """
    present = [i for i, f in enumerate(flags) if f is not None]
    if not present:
        return tuple(flags)
    agreed = ops.all_true(ops.stack([flags[i] for i in present]), group)
    out = list(flags)
    for k, i in enumerate(present):
        out[i] = agreed[k]
    return tuple(out)
