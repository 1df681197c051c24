"""PyTorch backend: in-place writes, device-resident scalars, branches on device values.

The seam's primitives (`protocol.BackendOps`), from modules that import only
those above them:

- `control`: branches on device values (`cond`), undone where not taken;
- `layout`: which gradients a kernel may walk as one block or write in place;
- `ops`, `scale_update` (on `torch._amp_update_scale_`), `multi` (unscale,
  finite check, norms by device and dtype), `float16_range`;
- `plans`: an optimizer's tensor lists per (device, dtype), cached;
- `host`: a step's scalars computed on the host where their tensors live;
- `foreach`, `adamw`, `fused`: the update rules; `kernels`: their registry.
"""

import torch

from lossscale.backends.torch.control import cond, cond_values
from lossscale.backends.torch.kernels import (
    fused_float16_range,
    fused_scale_update,
    fused_update,
    fused_weight_decay,
)
from lossscale.backends.torch.multi import (
    all_finite,
    checks_while_unscaling,
    finite_flags,
    finite_unscaled,
    global_norm,
    max_abs,
    peaks,
    unscale,
    unscale_checked,
)
from lossscale.backends.torch.ops import (
    INT_DTYPE,
    MUTABLE,
    NAME,
    abs,
    all_gather,
    all_max,
    all_true,
    asarray,
    assign,
    assign_add,
    assign_sub,
    cast,
    clip,
    copy,
    cos,
    dtype_name,
    exp,
    floor,
    full,
    host_control,
    is_native,
    isfinite,
    log,
    logical_and,
    logical_not,
    maximum,
    minimum,
    place,
    power,
    quiet,
    read,
    records_calls,
    several_participants,
    shape,
    sign,
    sqrt,
    square,
    stack,
    sum,
    to_numpy,
    unstack,
    where,
)

# `warnings.warn` cannot be traced: in a compiled step a warning is run
# once, at trace time, as a constant (see `telemetry.warn`).
from lossscale.mixed_precision import telemetry  # noqa: E402

torch.compiler.assume_constant_result(telemetry.warn)
