"""NumPy backend: the embedded default and the reference path.

The seam's primitives (`lossscale.backends.protocol.BackendOps`), gathered
from the modules that implement them:

- `parallel`: a thread pool over blocks, and the blocked max-|x| reduction;
- `ops`: arrays, in-place writes, elementwise math, reductions, `cond`;
- `fused`: in-place blocked Adam and SGD kernels;
- `kernels`: the registry of those kernels, by the name an optimizer declares.

Each module imports only those above it in this list.
"""

from lossscale.backends.numpy.kernels import (
    fused_float16_range,
    fused_scale_update,
    fused_update,
    fused_weight_decay,
)
from lossscale.backends.numpy.ops import (
    INT_DTYPE,
    MUTABLE,
    NAME,
    abs,
    all_finite,
    all_max,
    all_true,
    asarray,
    assign,
    assign_add,
    assign_sub,
    cast,
    checks_while_unscaling,
    clip,
    cond,
    cond_values,
    copy,
    cos,
    dtype_name,
    exp,
    finite_flags,
    finite_unscaled,
    floor,
    full,
    global_norm,
    host_control,
    is_native,
    isfinite,
    log,
    logical_and,
    logical_not,
    max_abs,
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
    unscale,
    unscale_checked,
    where,
)
