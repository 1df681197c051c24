"""`update_scale`: the plain loss-scale update in torch's own `_amp_update_scale_` kernel.

The fast path of `next_loss_scale` for a plain policy (`fused_scale_update`
in the kernel table), and `lossscale.torch.GradScaler`'s whole update; tested
against `next_loss_scale`'s generic selects.
"""

import torch

from lossscale.backends.torch import ops


def update_scale(
    scale,
    counter,
    finite,
    growth_steps,
    growth_factor,
    backoff_factor,
    floor,
    skip=None,
    in_place=False,
    scale_at_least=0.0,
):
    """The plain loss-scale update in torch's `_amp_update_scale_` kernel.

    That kernel (GradScaler's) does what `next_loss_scale` does for a plain
    policy: on overflow it backs off and resets the counter; otherwise it
    counts, and on the `growth_steps`-th step grows unless the result is not
    finite, and resets. It does not stop a backoff at `floor`, so the floor
    is applied after it, on overflowing steps only (`max(scale, skip *
    floor)`: the scale is positive). It works in place on an int32 counter
    and a float32 scale: with `in_place` it updates those given, else copies.

    `scale_at_least` is a lower bound of `scale` known on the host (0.0:
    none). Where it shows that a backoff cannot take the scale below `floor`
    the floor is not applied (no operation); where it shows the scale is at
    least `floor`, a growth or an unchanged scale stays above it, so the
    floor is applied on every step (one operation, not two). `finite` may
    be None where `skip` is given.
    """
    scale, counter = ops.unwrap(scale), ops.unwrap(counter)
    if skip is None:
        skip = (~ops.unwrap(finite)).to(torch.float32)
    if in_place and scale.dtype == torch.float32 and counter.dtype == torch.int32:
        new_scale, new_counter = scale, counter
    else:
        new_scale = scale.to(dtype=torch.float32, copy=True)
        new_counter = counter.to(dtype=torch.int32, copy=True)
    if skip.device != new_scale.device:
        skip = skip.to(new_scale.device)
    torch._amp_update_scale_(
        new_scale, new_counter, skip, growth_factor, backoff_factor, growth_steps
    )
    # Rounding the backed-off scale to float32 keeps it at or above `floor`
    # (a float32 number) where the exact product is; the host's product is
    # shrunk past its own double-precision rounding (2**-53 per operation).
    if scale_at_least * backoff_factor * (1 - 2.0**-50) < floor:
        new_scale.clamp_min_(floor if scale_at_least >= floor else skip * floor)
    if new_scale is scale:  # updated in place: nothing to cast back (a call saved per step)
        return new_scale, new_counter
    return new_scale.to(scale.dtype), new_counter.to(counter.dtype)
