"""JAX backend.

Arrays are immutable: `assign*` return the new array and the `Variable`
rebinds to it; branches on traced values become `lax.cond`. Every write
keeps the dtype *and weak type* it replaces, and `cond` returns what it was
given, so `jax.jit(opt.stateless_apply)` does not retrace. Arrays created
`like=` a sharded array take its sharding.
"""

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

from lossscale.backends._common import binary, bound, unary, unwrap

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
    """The sharding of a new array of `shape` next to `like` (else replicated), or None."""
    like = unwrap(like)
    if not isinstance(like, jax.Array) or isinstance(like, jax.core.Tracer):
        return None
    if not getattr(like, "committed", True) or not hasattr(like, "sharding"):
        return None
    sharding = like.sharding
    if tuple(like.shape) == tuple(shape):
        return sharding
    # A mesh first, even of one device: another kind would recompile a jitted step.
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
    # The attribute first: `jnp.asarray` of a donated (deleted) array raises.
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
    """`value` with exactly `storage`'s dtype and weak type (else a jitted step retraces)."""
    value = jnp.asarray(value, dtype=storage.dtype)
    if getattr(storage, "weak_type", False) and not getattr(value, "weak_type", False):
        return storage.at[...].set(value)  # keeps the target's weak type
    return value


def assign(storage, value):
    return _same_dtype(storage, jnp.broadcast_to(unwrap(value), storage.shape))


def assign_add(storage, value):
    return _same_dtype(storage, storage + unwrap(value))


def assign_sub(storage, value):
    return _same_dtype(storage, storage - unwrap(value))


def cast(x, dtype):
    return jnp.asarray(unwrap(x), dtype=dtype)


sqrt = unary(jnp.sqrt)
square = unary(jnp.square)
abs = unary(jnp.abs)  # noqa: A001 - the seam's name for |x|
sign = unary(jnp.sign)
exp = unary(jnp.exp)
log = unary(jnp.log)
cos = unary(jnp.cos)
floor = unary(jnp.floor)
isfinite = unary(jnp.isfinite)
logical_not = unary(jnp.logical_not)
power = binary(jnp.power)
maximum = binary(jnp.maximum)
minimum = binary(jnp.minimum)
logical_and = binary(jnp.logical_and)


def where(cond, x, y):
    return jnp.where(unwrap(cond), unwrap(x), unwrap(y))


def clip(x, lo, hi):
    return jnp.clip(unwrap(x), lo, hi)


def stack(values):
    """The scalars `values` as one vector."""
    return jnp.stack([unwrap(v) for v in values])


def unstack(x):
    """The entries of the vector `x`, as scalars."""
    return tuple(x[i] for i in range(x.shape[0]))


def sum(x):  # noqa: A001 - the seam's name for a full reduction
    return jnp.sum(unwrap(x))


def all_max(x, group=None):
    """The maximum of scalar `x` over `group`'s mapped axes (`shard_map` / `pmap`), if any.

    A reduction over a sharded global array is global already.
    """
    axes = _axes(group)
    x = unwrap(x)
    if axes is None:
        return x
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return lax.pmax(x, axes)
    # XLA's cross-device maximum drops NaN: whether any device held one travels beside it.
    both = lax.pmax(jnp.stack([x, jnp.isnan(x).astype(x.dtype)]), axes)
    return jnp.where(both[1] > 0, jnp.asarray(jnp.nan, x.dtype), both[0])


def all_true(flag, group=None):
    """Whether `flag` holds for every participant: `flag` itself, or over `group`'s axes."""
    axes = _axes(group)
    flag = unwrap(flag)
    if axes is None:
        return flag
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
