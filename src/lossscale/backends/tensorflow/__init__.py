"""TensorFlow backend: `tf.Variable` storage, masked eager branches, `tf.cond` in graphs.

The seam's primitives (`lossscale.backends.protocol.BackendOps`), gathered
from the modules that implement them:

- `ops`: tensors and `tf.Variable` storage, writes (in place on a
  `tf.Variable`, a new tensor under `stateless_apply`), elementwise math;
- `control`: branches on device values (`cond`): undone writes in
  eager mode, `tf.cond` inside a `tf.function`;
- `multi`: unscale, finite check and norms over lists of tensors;
- `replicas`: the skip decision agreed across `tf.distribute` replicas;
- `fused`: SGD on TensorFlow's fused training kernels;
- `compiled`: eager steps traced once, so that many small ops cost one call;
- `kernels`: the registry of update rules, by the name an optimizer
  declares.

Each module imports only those above it in this list. TensorFlow is
imported only when a `tf.Tensor` or `tf.Variable` is seen.
"""

from lossscale.backends.tensorflow.compiled import (
    all_finite,
    finite_flags,
    unscale,
    unscale_checked,
)
from lossscale.backends.tensorflow.control import (
    cond,
    cond_values,
)
from lossscale.backends.tensorflow.kernels import (
    fused_float16_range,
    fused_scale_update,
    fused_update,
    fused_weight_decay,
)
from lossscale.backends.tensorflow.multi import (
    finite_unscaled,
    global_norm,
    max_abs,
)
from lossscale.backends.tensorflow.ops import (
    INT_DTYPE,
    MUTABLE,
    NAME,
    abs,
    asarray,
    assign,
    assign_add,
    assign_sub,
    cast,
    checks_while_unscaling,
    clip,
    copy,
    cos,
    dense_gradient,
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
    shape,
    sign,
    sqrt,
    square,
    stack,
    sum,
    to_numpy,
    variable_storage,
    where,
)
from lossscale.backends.tensorflow.replicas import (
    all_max,
    all_true,
    several_participants,
)

__all__ = [
    "INT_DTYPE",
    "MUTABLE",
    "NAME",
    "abs",
    "all_finite",
    "all_max",
    "all_true",
    "asarray",
    "assign",
    "assign_add",
    "assign_sub",
    "cast",
    "checks_while_unscaling",
    "clip",
    "cond",
    "cond_values",
    "copy",
    "cos",
    "dense_gradient",
    "dtype_name",
    "exp",
    "finite_flags",
    "finite_unscaled",
    "floor",
    "full",
    "fused_float16_range",
    "fused_scale_update",
    "fused_update",
    "fused_weight_decay",
    "global_norm",
    "host_control",
    "is_native",
    "isfinite",
    "log",
    "logical_and",
    "logical_not",
    "max_abs",
    "maximum",
    "minimum",
    "place",
    "power",
    "quiet",
    "read",
    "records_calls",
    "several_participants",
    "shape",
    "sign",
    "sqrt",
    "square",
    "stack",
    "sum",
    "to_numpy",
    "unscale",
    "unscale_checked",
    "variable_storage",
    "where",
]
