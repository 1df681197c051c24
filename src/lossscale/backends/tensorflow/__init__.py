"""TensorFlow backend: `tf.Variable` storage, masked eager branches, `tf.cond` in graphs.

The seam's primitives (`protocol.BackendOps`), from modules that import only
those before them: `ops` (tensors, `tf.Variable` storage, writes, math),
`control` (`cond`), `multi` (unscale, finite check, norms), `replicas` (the
skip agreed across `tf.distribute` replicas), `fused` (SGD), `compiled`
(eager steps traced once) and `kernels` (the registry by name). TensorFlow
is imported only when a `tf.Tensor` or `tf.Variable` is seen.
"""

from lossscale.backends.tensorflow.compiled import (
    all_finite,
    finite_flags,
    unscale,
    unscale_checked,
)
from lossscale.backends.tensorflow.control import cond, cond_values
from lossscale.backends.tensorflow.kernels import (
    fused_float16_range,
    fused_scale_update,
    fused_update,
    fused_weight_decay,
)
from lossscale.backends.tensorflow.multi import finite_unscaled, global_norm, max_abs
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
    unstack,
    variable_storage,
    where,
)
from lossscale.backends.tensorflow.replicas import all_max, all_true, several_participants
