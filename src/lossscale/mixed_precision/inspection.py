"""What the loss-scale policy reads of a step's gradients: one measurement for every interface.

```
peaks[i]    = max |g_i|                          # each gradient's largest scaled magnitude
unscaled[i] = cast(peaks[i] / scale, dtype_i)    # dtype_i: what g_i is unscaled to
finite      = all(isfinite(unscaled))            # catches an overflow the unscaling causes
peak        = max(peaks)                         # growth_policy="headroom"
variable_finite[i] = isfinite(unscaled[i])       # telemetry
```

Division and rounding are monotone, so a gradient's largest magnitude
divided by the scale, in the dtype it is unscaled to, is its largest
unscaled magnitude, inf or NaN exactly when an unscaled value is: each
scaled gradient is read once, by the reduction that gives its peak.
`LossScaleOptimizer`, `lossscale.torch.GradScaler` and
`lossscale.optax.dynamic_loss_scale` gather the peaks their own way (one per
gradient where per-variable flags are kept, one per dtype otherwise: the
backend's `max_abs`, or torch's multi-tensor norm) and read them here. The
flag alone, where no statistic is kept, is the backends' fused check
(`unscale_checked`, `finite_unscaled`), not this.
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
        variable_finite: With telemetry (`policy.records_details`), one
            boolean scalar per peak, in order, None where the peak is None;
            else `()`.
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
        peaks: Each gradient's (or each group of gradients') largest scaled
            magnitude, a float32 scalar that is NaN or inf where the
            gradient holds one; None for an empty gradient.
        dtypes: Per peak, the dtype name its gradient is unscaled to, or
            None for a gradient the step does not unscale (an
            overwrite-with-gradient variable's): checked as it is, and left
            out of `peak`.
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
                each = ops.isfinite(values)
                for j, i in enumerate(members):
                    flags[i] = each[j]
    finite = ops.isfinite(ops.max_abs(checked)) if checked else ops.isfinite(like)
    peak = None
    if policy.growth_policy == "headroom":
        scaled = [
            peaks[i] for dtype, members in groups.items() if dtype is not None for i in members
        ]
        peak = ops.max_abs([ops.stack(scaled)]) if scaled else like
    return Inspection(finite, peak, tuple(flags) if policy.records_details else ())


def gradient_peaks(ops, grads, divided, by_variable):
    """`[(peak, positions)]`: the largest magnitudes of the non-empty `grads`, as they are.

    Taken before any unscaling (torch unscales in place). One per gradient
    when `by_variable` (telemetry flags each), else one per dtype and kind
    (divided by the scale or not).

    Args:
        ops: The backend's operations.
        grads: The scaled gradients (`None` entries allowed).
        divided: The positions of the gradients the step unscales.
        by_variable: Whether each gradient gets its own peak.
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

    Args:
        ops: The backend's operations.
        peaks: What `gradient_peaks` returned.
        unscaled: `{position: unscaled gradient}` of the divided gradients
            (each group is unscaled to its first member's dtype).
        scale: The loss scale.
        policy: The `LossScalePolicy`.
        variable_of: `position -> index` of its variable among `variable_count`.
        variable_count: How many variables the flags are indexed by.

    Returns:
        An `Inspection` whose `variable_finite` (with telemetry) holds
        `variable_count` entries, None where a variable had no peak.
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

    One collective for all of them (`ops.all_true` of their vector), where
    each participant checked its own block of every gradient. None entries
    (no gradient) stay None.
    """
    present = [i for i, f in enumerate(flags) if f is not None]
    if not present:
        return tuple(flags)
    agreed = ops.all_true(ops.stack([flags[i] for i in present]), group)
    out = list(flags)
    for k, i in enumerate(present):
        out[i] = agreed[k]
    return tuple(out)
