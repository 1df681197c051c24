"""JAX backend: immutable arrays, `lax.cond` branches, sharding-aware creation.

The seam's primitives (`lossscale.backends.protocol.BackendOps`), gathered
from the modules that implement them:

- `ops`: arrays (placed like their neighbours), writes that return the new
  array, elementwise math, reductions, `cond` as `lax.cond`;
- `multi`: unscale, the finite check and norms over lists of arrays;
- `float16_range`: many gradients' float16 range, one fused pass over each
  (the diagnostics' measurement);
- `fused`: Adam, AdamW and SGD with the loss-scale skip folded into their
  arithmetic;
- `kernels`: the registry of fused update rules, by the name an optimizer
  declares.

Each module imports only those above it in this list.
"""

from lossscale.backends.jax.kernels import (
    fused_float16_range,
    fused_scale_update,
    fused_update,
    fused_weight_decay,
)
from lossscale.backends.jax.multi import (
    all_finite,
    finite_flags,
    finite_unscaled,
    global_norm,
    max_abs,
    unscale,
    unscale_checked,
)
from lossscale.backends.jax.ops import (
    INT_DTYPE,
    MUTABLE,
    NAME,
    abs,
    all_max,
    all_mean,
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
    floor,
    full,
    host_control,
    is_native,
    is_traced,
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
