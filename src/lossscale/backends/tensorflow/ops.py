"""TensorFlow backend: `tf.Variable` storage, writes in place, elementwise math.

A `Variable` holds a `tf.Variable` (a user's, wrapped without copying, or one
made here), so an optimizer's slots are captured by `tf.function`, mirrored
under `tf.distribute` and tracked by `tf.train.Checkpoint`. Under
`stateless_apply` writes to a plain tensor return the new tensor. Reads are
snapshots; every write casts and broadcasts to the storage (no promotion).
"""

import contextlib
import operator
import re

import numpy as np
import tensorflow as tf
from tensorflow.python.autograph.core import config as autograph_config

from lossscale.backends._common import unwrap

# lossscale branches on tensors itself (`control.cond`): autograph need not
# rewrite it, which makes tracing a step many times slower.
if not any(r.matches("lossscale") for r in autograph_config.CONVERSION_RULES):
    autograph_config.CONVERSION_RULES += (autograph_config.DoNotConvert("lossscale"),)

NAME = "tensorflow"
MUTABLE = True
INT_DTYPE = "int32"


def is_native(x):
    return isinstance(x, (tf.Tensor, tf.Variable))


def dense_gradient(x):
    """A sparse gradient (`tf.IndexedSlices`) as a dense tensor (rows summed), else None."""
    return tf.convert_to_tensor(x) if isinstance(x, tf.IndexedSlices) else None


def records_calls():
    """Whether a front end may keep Python-side records of this call (see the protocol)."""
    return tf.executing_eagerly()


def host_control():
    """Whether a Python branch in a step is taken anew at each call: never (steps are traced)."""
    return False


def is_variable(x):
    """Whether `x` is a `tf.Variable` (mirrored ones included), written in place."""
    return isinstance(x, tf.Variable)


def _tensor(x):
    """`x` as a tensor: a `tf.Variable` read, a Variable unwrapped, a sparse gradient densified."""
    x = unwrap(x)
    if isinstance(x, tf.Variable):
        return x.value()
    if isinstance(x, tf.IndexedSlices):
        return tf.convert_to_tensor(x)
    return x


def asarray(x, dtype=None, like=None):
    # TensorFlow copies between devices where an op needs it: `like` places nothing.
    x = _tensor(x)
    if isinstance(x, tf.Tensor):
        return x if dtype is None else tf.cast(x, dtype)
    return tf.convert_to_tensor(np.asarray(x, dtype=dtype) if dtype is not None else x)


def full(shape, value, dtype, like=None):
    return tf.fill(tuple(shape), tf.constant(value, dtype=dtype))


def copy(x):
    # Tensors are immutable and a read is a snapshot: nothing to duplicate.
    return asarray(x)


def to_numpy(x):
    x = unwrap(x)
    if isinstance(x, (tf.Tensor, tf.Variable)) and not _concrete(x):
        raise ValueError(
            "A value inside a tf.function being traced has no NumPy value yet: read it "
            "outside the function (or return it). Received: a symbolic "
            f"{type(x).__name__} of shape {tuple(x.shape)}"
        )
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _concrete(x):
    if isinstance(x, tf.Variable):
        return tf.executing_eagerly()
    return not tf.is_symbolic_tensor(x)


def dtype_name(x):
    x = unwrap(x)
    dtype = x.dtype if isinstance(x, (tf.Tensor, tf.Variable)) else tf.convert_to_tensor(x).dtype
    return dtype.name


def shape(x):
    x = unwrap(x)
    return tuple(x.shape) if hasattr(x, "shape") else ()


def place(x, like):
    return asarray(x, like=like)


def variable_storage(value, like=None, name=None, trainable=False):
    """The `tf.Variable` a `lossscale.Variable` keeps for `value` (a `tf.Variable` is kept).

    A new one is made under `tf.init_scope` and follows `like` (mirrored by
    its strategy, or on its device). Its aggregation is NONE: every replica
    writes the same values (`replicas.all_true`).
    """
    if isinstance(value, tf.Variable):
        return value
    if isinstance(value, tf.Tensor) and tf.is_symbolic_tensor(value):
        raise ValueError(
            "A lossscale.Variable cannot be made from a tensor inside a tf.function being "
            "traced: create it (or build the optimizer) outside the function, or pass a "
            f"tf.Variable. Received: a symbolic tf.Tensor of shape {tuple(value.shape)}"
        )
    with tf.init_scope(), _placement(unwrap(like)):
        return tf.Variable(
            value,
            trainable=trainable,
            name=_valid_name(name),
            synchronization=tf.VariableSynchronization.ON_WRITE,
            aggregation=tf.VariableAggregation.NONE,
        )


def _placement(like):
    strategy = getattr(like, "distribute_strategy", None)
    if strategy is not None:
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            raise ValueError(
                "The optimizer's variables are mirrored like the model variables they "
                "belong to, and tf.distribute makes mirrored variables outside "
                "`strategy.run` only: build the optimizer first, e.g. "
                "`optimizer.build(model.trainable_variables)`. Received: a first `apply` "
                f"inside `strategy.run`, for {like.name!r}"
            )
        return strategy.scope()
    if isinstance(like, tf.Variable):
        return tf.device(like.device)
    if like is None and tf.distribute.has_strategy():
        return tf.distribute.get_strategy().scope()
    return contextlib.nullcontext()


def _valid_name(name):
    name = re.sub(r"[^A-Za-z0-9_.\-/]", "_", name or "variable")
    return name if re.match(r"[A-Za-z0-9.]", name) else f"v{name}"


def read(storage):
    return storage.value() if isinstance(storage, tf.Variable) else storage


def _value_for(storage, value):
    """`value` as a tensor of `storage`'s dtype and shape."""
    value = _tensor(value)
    dtype = storage.dtype
    if isinstance(value, tf.Tensor):
        if value.dtype != dtype:
            value = tf.cast(value, dtype)
    else:
        value = tf.convert_to_tensor(np.asarray(value, dtype=dtype.as_numpy_dtype))
    if value.shape != storage.shape:
        value = tf.broadcast_to(value, storage.shape)
    return value


def _write(storage, new):
    """Stores `new` (already `storage`'s dtype and shape)."""
    if isinstance(storage, tf.Variable):
        storage.assign(new, read_value=False)
        return storage
    return new


def assign(storage, value):
    return _write(storage, _value_for(storage, value))


def _update(storage, value, method, op):
    value = _value_for(storage, value)
    if isinstance(storage, tf.Variable):
        getattr(storage, method)(value, read_value=False)
        return storage
    return _write(storage, op(read(storage), value))


def assign_add(storage, value):
    return _update(storage, value, "assign_add", operator.add)


def assign_sub(storage, value):
    return _update(storage, value, "assign_sub", operator.sub)


def cast(x, dtype):
    x = _tensor(x)
    if isinstance(x, tf.Tensor):
        return x if x.dtype == dtype else tf.cast(x, dtype)
    return tf.constant(x, dtype=dtype)


def _unary(fn):
    return lambda x: fn(_tensor(x))


def _pair(x, y):
    """`x` and `y` as tensors: a Python number takes the other's dtype (no promotion)."""
    x, y = _tensor(x), _tensor(y)
    if isinstance(x, tf.Tensor) and not isinstance(y, tf.Tensor):
        y = tf.constant(y, dtype=x.dtype)
    elif isinstance(y, tf.Tensor) and not isinstance(x, tf.Tensor):
        x = tf.constant(x, dtype=y.dtype)
    return x, y


def _binary(fn):
    return lambda x, y: fn(*_pair(x, y))


sqrt = _unary(tf.sqrt)
square = _unary(tf.square)
abs = _unary(tf.abs)  # noqa: A001 - the seam's name for |x|
sign = _unary(tf.sign)
exp = _unary(tf.exp)
log = _unary(tf.math.log)
cos = _unary(tf.cos)
floor = _unary(tf.floor)
isfinite = _unary(tf.math.is_finite)
logical_not = _unary(tf.logical_not)
power = _binary(tf.pow)
maximum = _binary(tf.maximum)
minimum = _binary(tf.minimum)
logical_and = _binary(tf.logical_and)


def where(cond, x, y):
    x, y = _pair(x, y)
    return tf.where(_tensor(cond), x, y)


def stack(values):
    """The scalars `values` as one vector."""
    return tf.stack([_tensor(v) for v in values])


def unstack(x):
    """The entries of the vector `x`, as scalars."""
    return tuple(tf.unstack(x))


def clip(x, lo, hi):
    x = _tensor(x)
    return tf.clip_by_value(x, tf.cast(lo, x.dtype), tf.cast(hi, x.dtype))


def sum(x):  # noqa: A001 - the seam's name for a full reduction
    return tf.reduce_sum(_tensor(x))


def quiet():
    # TensorFlow raises no floating-point warnings.
    return contextlib.nullcontext()


def checks_while_unscaling():
    """False: `unscale_checked` divides, then checks."""
    return False
