"""NumPy backend: the embedded default and the reference path; writes are in place."""

import numpy as np

from lossscale.backends._common import binary, unary, unscale_then_check, unwrap
from lossscale.backends.numpy import parallel

NAME = "numpy"
MUTABLE = True
INT_DTYPE = "int32"


def is_native(x):
    return isinstance(x, (np.ndarray, np.generic))


def records_calls():
    """Whether a front end may keep Python-side records of this call (see the protocol)."""
    return True


def host_control():
    """Whether a Python branch in a step is taken anew at each call: always, on NumPy."""
    return True


def asarray(x, dtype=None, like=None):
    return np.asarray(unwrap(x), dtype=dtype)


def full(shape, value, dtype, like=None):
    return np.full(shape, value, dtype=dtype)


def copy(x):
    return np.array(unwrap(x), copy=True)


def to_numpy(x):
    return np.asarray(unwrap(x))


# `dtype.name` is computed in Python on every access: remembered per dtype.
_DTYPE_NAMES = {}


def dtype_name(x):
    x = unwrap(x)
    dtype = x.dtype if isinstance(x, (np.ndarray, np.generic)) else np.asarray(x).dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


def shape(x):
    x = unwrap(x)
    return x.shape if isinstance(x, np.ndarray) else tuple(np.shape(x))


def place(x, like):
    return np.asarray(unwrap(x))


def read(storage):
    return storage


def assign(storage, value):
    np.copyto(storage, unwrap(value), casting="same_kind")
    return storage


def assign_add(storage, value):
    np.add(storage, unwrap(value), out=storage, casting="same_kind")
    return storage


def assign_sub(storage, value):
    np.subtract(storage, unwrap(value), out=storage, casting="same_kind")
    return storage


def cast(x, dtype):
    x = unwrap(x)
    if isinstance(x, np.ndarray) and x.dtype == dtype:
        return x
    return np.asarray(x, dtype=dtype)


sqrt = unary(np.sqrt)
square = unary(np.square)
abs = unary(np.abs)  # noqa: A001 - the seam's name for |x|
sign = unary(np.sign)
exp = unary(np.exp)
log = unary(np.log)
cos = unary(np.cos)
floor = unary(np.floor)
isfinite = unary(np.isfinite)
logical_not = unary(np.logical_not)
power = binary(np.power)
maximum = binary(np.maximum)
minimum = binary(np.minimum)
logical_and = binary(np.logical_and)


def where(cond, x, y):
    return np.where(unwrap(cond), unwrap(x), unwrap(y))


def clip(x, lo, hi):
    return np.clip(unwrap(x), lo, hi)


def sum(x):  # noqa: A001 - the seam's name for a full reduction
    return np.sum(unwrap(x))


def stack(values):
    """The scalars `values` as one vector."""
    return np.stack([np.asarray(unwrap(v)) for v in values])


def unstack(x):
    """The entries of the vector `x`, as 0-d arrays."""
    return tuple(x[i, ...] for i in range(len(x)))


def unscale(grads, scale, in_place=False):
    # NumPy leaves the caller's arrays alone despite `in_place`.
    scale = unwrap(scale)
    divisors = {}  # the scale cast once per gradient dtype
    out = []
    for g in grads:
        g = unwrap(g)
        if g.dtype.itemsize < 4:
            g = g.astype(np.float32)
        divisor = divisors.get(g.dtype)
        if divisor is None:
            divisor = divisors[g.dtype] = scale.astype(g.dtype)
        out.append(g / divisor)
    return out


def unscale_checked(grads, scale, in_place=False):
    """`(unscaled, finite, skip)`: `unscale`, then `finite_flags` of the result."""
    return unscale_then_check(unscale, finite_flags, grads, scale, in_place)


def all_finite(arrays):
    # One pass and no boolean copy: a sum of squares is finite when every
    # element is; where it overflows, the exact two-pass check settles it.
    with np.errstate(over="ignore", invalid="ignore"):
        for a in arrays:
            a = unwrap(a)
            if not a.size:
                continue
            if a.dtype.kind == "f" and a.dtype.itemsize >= 4 and a.flags.c_contiguous:
                flat = a.reshape(-1)
                if np.isfinite(np.dot(flat, flat)):
                    continue
            if not (np.isfinite(a.max()) and np.isfinite(a.min())):
                return np.asarray(False)
    return np.asarray(True)


def finite_flags(arrays):
    finite = all_finite(arrays)
    return finite, np.asarray(np.float32(not finite))


def global_norm(arrays):
    total = np.float64(0.0) if not arrays else None
    for a in arrays:
        a = unwrap(a)
        flat = a.reshape(-1)
        if flat.dtype.itemsize < 4:
            flat = flat.astype(np.float32)
        sq = np.dot(flat, flat) if a.dtype.kind == "f" else np.sum(np.square(flat))
        total = sq if total is None else total + sq
    return np.sqrt(total)


def max_abs(arrays):
    """Largest |x| over all arrays as a float32 scalar (NaN if any NaN)."""
    return parallel.peak_magnitude(arrays)


def finite_unscaled(arrays, scale):
    """Whether every element of `arrays`, divided by `scale`, is finite (by the peak)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.isfinite(max_abs(arrays) / unwrap(scale))


def all_max(x, group=None):
    """The maximum of scalar `x` over all participants: one process here."""
    if group is not None:
        raise ValueError(
            "`process_group` applies to torch.distributed only; NumPy arrays "
            f"live in one process. Received: process_group={group!r}"
        )
    return unwrap(x)


def all_true(flag, group=None):
    """Whether `flag` holds for every participant: `flag` itself here."""
    return all_max(flag, group)  # the same checks of `group`


def several_participants(group=None):
    """False: NumPy arrays live in one process."""
    all_max(0.0, group)  # the same checks of `group`
    return False


def cond_values(pred, true_fn, false_fn):
    return true_fn() if bool(unwrap(pred)) else false_fn()


def cond(pred, true_fn, false_fn, variables):
    branch = true_fn if bool(unwrap(pred)) else false_fn
    if branch is not None:
        branch()


def quiet():
    # A skipped overflow step computes inf/NaN on purpose.
    return np.errstate(over="ignore", invalid="ignore", divide="ignore")


def checks_while_unscaling():
    """False: `unscale_checked` divides, then checks."""
    return False
