"""JAX backend: immutable arrays, `lax.cond` branches, sharding-aware creation.

The seam's primitives (`lossscale.backends.protocol.BackendOps`), gathered
from the modules that implement them:

- `ops`: arrays (placed like their neighbours), writes that return the new
  array, elementwise math, reductions, `cond` as `lax.cond`;
- `kernels`: the registry of fused update rules, by the name an optimizer
  declares.

Each module imports only those above it in this list.
"""

from lossscale.backends.jax.kernels import (
    fused_scale_update,
    fused_update,
    fused_weight_decay,
)
from lossscale.backends.jax.ops import (
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
    clip,
    cond,
    copy,
    cos,
    dtype_name,
    exp,
    finite_flags,
    finite_unscaled,
    floor,
    full,
    gated,
    global_norm,
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
    shape,
    sign,
    sqrt,
    square,
    sum,
    to_numpy,
    unscale,
    unscale_checked,
    where,
)
