"""JAX backend.

JAX arrays are immutable: `assign*` return the new array and the `Variable`
rebinds to it. Branches on traced values become `lax.cond` over the values
of the variables they may write, so the same optimizer code traces under
`jax.jit`.

Two invariants keep `jax.jit(optimizer.stateless_apply)` from retracing:
every write returns exactly the dtype *and weak type* of the value it
replaces, and `cond` returns what it was given, branch for branch. Arrays
created next to a sharded array (`like=`) are placed with its sharding, so
optimizer slots follow the parameters they belong to.
"""

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

from lossscale.backends._common import bound, masked, unscale_then_check, unwrap

NAME = "jax"
MUTABLE = False
INT_DTYPE = "int32"


def is_native(x):
    return isinstance(x, jax.Array)


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
    if len(sharding.device_set) == 1:
        return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
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


# `mask`: a boolean scalar set by `gated` (or None); where it is False the
# write is dropped. XLA fuses the select into the computation of the value.
def assign(storage, value, mask=None):
    return _masked(storage, jnp.broadcast_to(unwrap(value), storage.shape), mask)


def assign_add(storage, value, mask=None):
    return _masked(storage, storage + unwrap(value), mask)


def assign_sub(storage, value, mask=None):
    return _masked(storage, storage - unwrap(value), mask)


def _masked(storage, value, mask):
    if mask is not None:
        value = jnp.where(mask, value, storage)
    return _same_dtype(storage, value)


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


def sum(x):  # noqa: A001 - the seam's name for a full reduction
    return jnp.sum(unwrap(x))


def unscale(grads, scale, in_place=False, reciprocal=False):
    """`grads` divided by `scale` (half-precision gradients in float32).

    Arrays are immutable: `in_place` has nothing to permit. `reciprocal`
    (the caller guarantees every scale is a power of two) multiplies by the
    reciprocal instead, which rounds exactly as division does and which XLA
    fuses into each reader of a gradient, where it writes a quotient out to
    a scratch buffer first. The reciprocal is kept a normal number, so that
    a flush-to-zero CPU mode does not zero it: above 2^126 the gradient is
    halved first (exact) and multiplied by `2 / scale`.
    """
    scale = unwrap(scale)
    factors, out = {}, []
    for g in grads:
        g = unwrap(g)
        if g.dtype.itemsize < 4:
            g = g.astype(jnp.float32)
        s = scale.astype(g.dtype)
        if not reciprocal:
            out.append(g / s)
            continue
        if g.dtype not in factors:
            big = s > 2.0**126
            factors[g.dtype] = (
                jnp.where(big, 0.5, 1.0).astype(g.dtype),
                jnp.where(big, 2 / s, 1 / s),
            )
        half, inverse = factors[g.dtype]
        out.append(g * half * inverse)
    return out


def unscale_checked(grads, scale, in_place=False):
    """`(unscaled, finite, skip)`: `unscale`, then `finite_flags` of the result."""
    return unscale_then_check(unscale, finite_flags, grads, scale, in_place)


def all_finite(arrays):
    # The largest |x| of an array is inf or NaN exactly when one of its
    # elements is (max propagates NaN). XLA fuses that float reduction into
    # one read of the array, where `all(isfinite(x))` first writes a boolean
    # copy of it: 19% off a 16M-parameter jitted Adam step on CPU. Large
    # arrays take a cheaper plain sum first (`_finite_large`).
    return finite_unscaled(arrays, None)


def finite_unscaled(arrays, scale):
    """Whether every element of `arrays`, divided by `scale`, is finite.

    The flag `isfinite(max_abs(arrays) / scale)`, always (`scale=None`:
    not divided, as `all_finite`), computed in fewer passes where it can be
    (`_finite_large`).
    """
    summed = _SUMMED if jax.default_backend() in _SUMS_FIRST_ON else None
    small, large = [], []
    for a in map(unwrap, arrays):
        if a.size:
            (large if summed is not None and a.size >= summed else small).append(a)
    flags = []
    if small:
        peak = jnp.max(jnp.stack(_peaks(small)))
        flags.append(jnp.isfinite(peak if scale is None else peak / unwrap(scale)))
    if large:
        flags.append(_finite_large(large, None if scale is None else unwrap(scale)))
    if not flags:
        return jnp.asarray(True)
    return flags[0] if len(flags) == 1 else jnp.logical_and(*flags)


# Arrays of at least this many elements are checked by their sums first,
# where the default backend is one of these. Not on GPUs: there XLA reads a
# `conditional`'s predicate back to the host, a wait inside every step, and
# a maximum reads no more bytes than a sum.
_SUMMED = 1 << 18
_SUMS_FIRST_ON = frozenset({"cpu"})


def _finite_large(arrays, scale):
    """`isfinite(max_abs(arrays) / scale)` for large arrays, from their sums where it can.

    A sum is finite only when every element is (inf and NaN propagate
    through additions in any order), and dividing by a scale of at least 1
    cannot overflow: finite sums and such a scale settle the flag. A plain
    sum is one library call on XLA's CPU backend, about twice as fast as
    the NaN-propagating max of magnitudes (0.63 against 1.35 ms over eight
    float32 arrays of 1M). Only where a sum is not finite (an overflow of
    the sum itself included) or the scale is below 1 does `lax.cond` take
    the exact branch; it returns a scalar, so it copies no array.
    """
    # In float32, the dtype the peaks are compared in: a float64 element
    # beyond float32's range makes both inf.
    sums = [jnp.sum(a, dtype=jnp.float32) for a in arrays]
    quick = jnp.all(jnp.stack([jnp.isfinite(s) for s in sums]))
    if scale is not None:
        quick = jnp.logical_and(quick, scale >= 1)

    def exact():
        peak = jnp.max(jnp.stack(_peaks(arrays)))
        return jnp.isfinite(peak if scale is None else peak / scale)

    return lax.cond(quick, lambda: jnp.asarray(True), exact)


# Arrays up to this size are reduced together, concatenated per dtype into
# chunks of at most `_CHUNK` elements: on CPU each reduction is several XLA
# thunks, so a 400-tensor model's check took 645 us one tensor at a time and
# 263 us concatenated. Larger arrays are reduced in place (a concatenation
# would copy them).
_SMALL, _CHUNK = 4096, 1 << 16


def _peaks(arrays):
    """Float32 largest magnitudes whose maximum is that of every element of `arrays`."""
    peaks, chunks = [], {}
    for a in map(unwrap, arrays):
        if not a.size:
            continue
        if a.size > _SMALL:
            peaks.append(jnp.max(jnp.abs(a)).astype(jnp.float32))
            continue
        chunk = chunks.setdefault(a.dtype, [[], 0])
        if chunk[1] + a.size > _CHUNK:
            peaks.append(_peak_of(chunk[0]))
            chunk[:] = [[], 0]
        chunk[0].append(a.ravel())
        chunk[1] += a.size
    peaks += [_peak_of(parts) for parts, _ in chunks.values() if parts]
    return peaks


def _peak_of(parts):
    joined = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return jnp.max(jnp.abs(joined)).astype(jnp.float32)


def finite_flags(arrays):
    finite = all_finite(arrays)
    return finite, jnp.logical_not(finite).astype(jnp.float32)


def global_norm(arrays):
    arrays = [unwrap(a) for a in arrays]
    squares = [
        jnp.sum(jnp.square(a.astype(jnp.float32) if a.dtype.itemsize < 4 else a)) for a in arrays
    ]
    return jnp.sqrt(jnp.sum(jnp.stack(squares)))


def max_abs(arrays):
    """Largest |x| over all arrays as a float32 scalar (NaN if any NaN)."""
    peaks = _peaks(arrays)
    return jnp.max(jnp.stack(peaks)) if peaks else jnp.asarray(0.0, jnp.float32)


def all_max(x, group=None):
    """The maximum of scalar `x` over all participants.

    A JAX reduction over a sharded global array is already global (XLA
    inserts the cross-device collective), so there is nothing to add.
    """
    if group is not None:
        raise ValueError(
            "`process_group` applies to torch.distributed only; JAX arrays are "
            f"global across their sharding. Received: process_group={group!r}"
        )
    return unwrap(x)


def all_true(flag, group=None):
    """Whether `flag` holds for every participant: `flag` itself here."""
    return all_max(flag, group)  # the same checks of `group`


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
                return [v._storage for v in variables]

        return run

    new = lax.cond(pred, branch(true_fn), branch(false_fn), [v._storage for v in variables])
    for v, s in zip(variables, new):
        v._storage = s


def gated(pred, fn, variables, skip=None, cell=None):
    """Runs `fn` so that its writes to `variables` take effect only where `pred` holds.

    A concrete `pred` takes a plain `if`. A traced one runs `fn` once with
    `pred` set as every variable's write mask (combined with an enclosing
    one): each plain write becomes a select, which XLA fuses into the
    computation of the value, and a fused kernel that folds the mask into
    its arithmetic (`kernels`) reads it there. No `lax.cond`, so no
    full-size copies of the branch's buffers; for a branch whose writes
    cannot be folded, `cond` is the cheaper choice. `skip` is torch's and
    ignored here; `cell`, the variables' cell if known, goes to `masked`.
    """
    pred = unwrap(pred)
    if not isinstance(pred, jax.core.Tracer):
        if bool(pred):
            fn()
        return
    variables = list(variables)
    outer = variables[0]._write_mask if variables else None
    with masked(variables, pred if outer is None else jnp.logical_and(outer, pred), cell):
        fn()


def quiet():
    return contextlib.nullcontext()
