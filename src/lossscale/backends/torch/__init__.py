"""PyTorch backend: in-place writes, device-resident scalars, branches on device values.

The seam's primitives (`lossscale.backends.protocol.BackendOps`), gathered
from the modules that implement them:

- `control`: branches on device values (`cond`), undone where not taken;
- `layout`: which gradients a kernel may walk as one block or write in place;
- `ops`: tensors, in-place writes, elementwise math;
- `scale_update`: the plain loss-scale update on `torch._amp_update_scale_`;
- `multi`: multi-tensor unscale, finite check and norms, by (device, dtype);
- `float16_range`: many gradients' float16 range in a fixed number of operations;
- `plans`: an optimizer's tensor lists per (device, dtype), cached between steps;
- `host`: a step's scalars computed on the host where their tensors live there
  (Adam's step size on the CPU);
- `foreach`: `torch._foreach_*` versions of the update rules;
- `adamw`: decoupled weight decay as Keras 3's torch backend rounds it;
- `fused`: Adam, AdamW and SGD on torch's fused kernels (traced on the CPU:
  one opaque `lossscale::fused_adam_`);
- `kernels`: the registry of those kernels, by the name an optimizer declares.

Each module imports only those above it in this list.
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
    where,
)

# `warnings.warn` cannot be traced: in a compiled step a warning is run
# once, at trace time, as a constant (see `telemetry.warn`).
from lossscale.mixed_precision import telemetry  # noqa: E402

torch.compiler.assume_constant_result(telemetry.warn)
