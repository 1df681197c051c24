"""`update_scale`: the plain loss-scale update in torch's own `_amp_update_scale_` kernel."""

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
    """The plain loss-scale update in torch's `_amp_update_scale_` kernel (GradScaler's).

    The kernel does not stop a backoff at `floor`, so the floor is applied
    after it, on overflowing steps only. With `in_place` an int32 counter and
    a float32 scale are updated where they are. `scale_at_least` (a host
    lower bound of `scale`) can spare the floor or apply it unconditionally.
    `finite` may be None where `skip` is given.
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
    # The host's product is shrunk past its own double-precision rounding.
    if scale_at_least * backoff_factor * (1 - 2.0**-50) < floor:
        new_scale.clamp_min_(floor if scale_at_least >= floor else skip * floor)
    if new_scale is scale:  # updated in place: nothing to cast back
        return new_scale, new_counter
    return new_scale.to(scale.dtype), new_counter.to(counter.dtype)
