"""JAX backend.

JAX arrays are immutable: `assign*` return the new array and the `Variable`
rebinds to it. Branches on traced values become `lax.cond` over the values
of the variables they may write, so the same optimizer code traces under
`jax.jit`.

Two invariants keep `jax.jit(opt.stateless_apply)` from retracing:
every write returns exactly the dtype *and weak type* of the value it
replaces, and `cond` returns what it was given, branch for branch. Arrays
created next to a sharded array (`like=`) are placed with its sharding, so
optimizer slots follow the parameters they belong to.
"""

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

from lossscale.backends._common import bound, unwrap

NAME = "jax"
MUTABLE = False
INT_DTYPE = "int32"


def is_native(x):
    return isinstance(x, jax.Array)


def records_calls():
    """Whether a front end may keep Python-side records of this call (see the protocol)."""
    return True  # a traced call runs its Python once, at the trace


def host_control():
    """Whether a Python branch in a step is taken anew at each call: never (steps are traced)."""
    return False


def is_traced(x):
    """Whether `x` is a tracer (of `jit`, `grad`, `vmap`...), which no variable may keep."""
    return isinstance(unwrap(x), jax.core.Tracer)


def _sharding_like(like, shape):
    """The sharding a new array of `shape` should take next to `like`, or None.

    Same shape: `like`'s own sharding. Another shape (a scalar next to a
    matrix, say): replicated over `like`'s devices. Traced values carry no
    placement, and uncommitted arrays (placed by default) need none.
    """
    like = unwrap(like)
    if not isinstance(like, jax.Array) or isinstance(like, jax.core.Tracer):
        return None
    if not getattr(like, "committed", True) or not hasattr(like, "sharding"):
        return None
    sharding = like.sharding
    if tuple(like.shape) == tuple(shape):
        return sharding
    # A mesh first, even of one device: a jitted step returns the scalars
    # replicated over it, and a placement of another kind would compile the
    # step again at its second call.
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    if len(sharding.device_set) == 1:
        return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
    return None


def _place(x, like):
    sharding = _sharding_like(like, x.shape)
    return x if sharding is None else jax.device_put(x, sharding)


def asarray(x, dtype=None, like=None):
    return _place(jnp.asarray(unwrap(x), dtype=dtype), like)


def full(shape, value, dtype, like=None):
    return _place(jnp.full(tuple(shape), value, dtype=dtype), like)


def copy(x):
    return jnp.array(unwrap(x), copy=True)


def to_numpy(x):
    import numpy as np

    return np.asarray(unwrap(x))


def dtype_name(x):
    # Read the attribute when there is one: a donated (deleted) array still
    # knows its dtype, but `jnp.asarray` of it raises.
    x = unwrap(x)
    return (x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype).name


def shape(x):
    x = unwrap(x)
    return tuple(x.shape) if hasattr(x, "shape") else tuple(jnp.shape(x))


def place(x, like):
    return _place(jnp.asarray(unwrap(x)), like)


def read(storage):
    return storage


def _same_dtype(storage, value):
    """`value` with exactly `storage`'s dtype and weak type.

    A weakly typed scalar (`jnp.asarray(0.1)`) passed to a jitted
    `stateless_apply` must come back weakly typed: a strong result would
    change the input signature of the next step and retrace it.
    """
    value = jnp.asarray(value, dtype=storage.dtype)
    if getattr(storage, "weak_type", False) and not getattr(value, "weak_type", False):
        # `.at[...].set` is jax.numpy's public way to write into an array
        # while keeping the target's weak type.
        return storage.at[...].set(value)
    return value


def assign(storage, value):
    return _same_dtype(storage, jnp.broadcast_to(unwrap(value), storage.shape))


def assign_add(storage, value):
    return _same_dtype(storage, storage + unwrap(value))


def assign_sub(storage, value):
    return _same_dtype(storage, storage - unwrap(value))


def cast(x, dtype):
    return jnp.asarray(unwrap(x), dtype=dtype)


def _unary(fn):
    return lambda x: fn(unwrap(x))


def _binary(fn):
    return lambda x, y: fn(unwrap(x), unwrap(y))


sqrt = _unary(jnp.sqrt)
square = _unary(jnp.square)
abs = _unary(jnp.abs)  # noqa: A001 - the seam's name for |x|
sign = _unary(jnp.sign)
exp = _unary(jnp.exp)
log = _unary(jnp.log)
cos = _unary(jnp.cos)
floor = _unary(jnp.floor)
isfinite = _unary(jnp.isfinite)
logical_not = _unary(jnp.logical_not)
power = _binary(jnp.power)
maximum = _binary(jnp.maximum)
minimum = _binary(jnp.minimum)
logical_and = _binary(jnp.logical_and)


def where(cond, x, y):
    return jnp.where(unwrap(cond), unwrap(x), unwrap(y))


def clip(x, lo, hi):
    return jnp.clip(unwrap(x), lo, hi)


def stack(values):
    """The scalars `values` as one vector."""
    return jnp.stack([unwrap(v) for v in values])


def sum(x):  # noqa: A001 - the seam's name for a full reduction
    return jnp.sum(unwrap(x))


def all_max(x, group=None):
    """The maximum of scalar `x` over all participants.

    A JAX reduction over a sharded global array is already global (XLA
    inserts the cross-device collective), so there is nothing to add.
    Inside `shard_map` or `pmap`, where each device holds its own block,
    `group` names the mapped axes (a string or a tuple of them, an
    `axis_name`) whose devices take the maximum together (`lax.pmax`).
    """
    axes = _axes(group)
    x = unwrap(x)
    if axes is None:
        return x
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return lax.pmax(x, axes)
    # XLA's cross-device maximum drops a NaN where another device holds a
    # number: whether any device held one travels beside it (one collective).
    both = lax.pmax(jnp.stack([x, jnp.isnan(x).astype(x.dtype)]), axes)
    return jnp.where(both[1] > 0, jnp.asarray(jnp.nan, x.dtype), both[0])


def all_true(flag, group=None):
    """Whether `flag` holds for every participant: `flag` itself, or over `group`'s axes."""
    axes = _axes(group)
    flag = unwrap(flag)
    if axes is None:
        return flag
    # (`pmin` takes numbers: the flag as 0 or 1.)
    return lax.pmin(flag.astype(jnp.int32), axes) > 0


def several_participants(group=None):
    """Whether `group` names mapped axes (`shard_map` / `pmap`) to agree over."""
    return _axes(group) is not None


def all_mean(x, group):
    """The mean of `x` over the mapped axes `group` (`lax.pmean`)."""
    return lax.pmean(unwrap(x), _axes(group))


def _axes(group):
    """`group` as mapped axis names, or None (global arrays: nothing to agree over)."""
    if group is None or isinstance(group, (str, tuple)):  # checked by the optimizers
        return group
    raise ValueError(
        "`process_group` applies to torch.distributed only; JAX arrays are global across "
        "their sharding (inside `shard_map` or `pmap`, pass the mapped axes as "
        f"`axis_name`). Received: process_group={group!r}"
    )


def cond(pred, true_fn, false_fn, variables):
    pred = unwrap(pred)
    if not isinstance(pred, jax.core.Tracer):
        branch = true_fn if bool(pred) else false_fn
        if branch is not None:
            branch()
        return
    variables = list(variables)
    false_fn = false_fn or (lambda: None)

    def branch(fn):
        def run(storages):
            with bound(variables, storages):
                fn()
                return [v.storage for v in variables]

        return run

    new = lax.cond(pred, branch(true_fn), branch(false_fn), [v.storage for v in variables])
    for v, s in zip(variables, new):
        v.rebind(s)


def cond_values(pred, true_fn, false_fn):
    """`true_fn()` where `pred` holds, else `false_fn()`: `lax.cond` on a traced `pred`."""
    pred = unwrap(pred)
    if not isinstance(pred, jax.core.Tracer):
        return true_fn() if bool(pred) else false_fn()
    return lax.cond(pred, true_fn, false_fn)


def quiet():
    return contextlib.nullcontext()


def checks_while_unscaling():
    """False: `unscale_checked` divides, then checks."""
    return False
