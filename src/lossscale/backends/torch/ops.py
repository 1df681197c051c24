"""PyTorch backend.

A `Variable` wraps a user's tensor or `nn.Parameter` without copying; reads
go through `.detach()` so optimizer arithmetic never records autograd history,
and writes are in place so the user's module sees every update.

Scalars an optimizer creates (learning rate, iterations, loss scale) live on
the device of the first variable it was built with, so a step needs no
host round trip.
"""

import contextlib
import contextvars
import numbers

import torch

from lossscale.backends._common import unwrap

NAME = "torch"
MUTABLE = True
INT_DTYPE = "int32"


def _dtype(name):
    return name if isinstance(name, torch.dtype) else getattr(torch, str(name))


def _device(like):
    like = unwrap(like)
    return like.device if isinstance(like, torch.Tensor) else None


def is_native(x):
    return isinstance(x, torch.Tensor)


def asarray(x, dtype=None, like=None):
    x = unwrap(x)
    device = _device(like)
    if isinstance(x, torch.Tensor):
        return x.to(device=device or x.device, dtype=_dtype(dtype) if dtype else x.dtype)
    if hasattr(x, "__array__") and not isinstance(x, (int, float, bool)):
        import numpy as np

        x = torch.as_tensor(np.asarray(x))
        return x.to(device=device or "cpu", dtype=_dtype(dtype) if dtype else x.dtype)
    return torch.as_tensor(x, dtype=_dtype(dtype) if dtype else None, device=device)


def full(shape, value, dtype, like=None):
    return torch.full(tuple(shape), value, dtype=_dtype(dtype), device=_device(like))


def copy(x):
    return unwrap(x).detach().clone()


def to_numpy(x):
    x = unwrap(x).detach().cpu()
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def dtype_name(x):
    return str(unwrap(x).dtype).removeprefix("torch.")


def shape(x):
    return tuple(unwrap(x).shape)


def place(x, like):
    return asarray(x, like=like)


def read(storage):
    return storage.detach()


# Masked execution. `cond` on a tensor predicate runs both branches, each
# under a boolean 0-d mask (nested conds combine theirs), and every write
# below selects between the new and the old value on the device. Nothing
# reads the predicate on the host, so a step never waits for the device,
# and a value computed in the branch not taken (a NaN from an overflowing
# gradient, say) is never stored.
_MASK = contextvars.ContextVar("lossscale_torch_mask", default=None)


def active_mask():
    """The boolean 0-d tensor gating writes, or None outside any `cond`."""
    return _MASK.get()


@contextlib.contextmanager
def masked(mask):
    """Runs the block with `mask` (a boolean 0-d tensor) gating every write."""
    token = _MASK.set(mask)
    try:
        yield
    finally:
        _MASK.reset(token)


def mask_on(mask, device):
    """`mask` on `device` (no copy when it is already there)."""
    return mask if mask.device == device else mask.to(device)


def select_into(storage, mask, new):
    """`storage[...] = where(mask, new, storage)`, in place."""
    mask = mask_on(mask, storage.device)
    if isinstance(new, torch.Tensor) and new.dtype == storage.dtype and new.shape == storage.shape:
        torch.where(mask, new, storage, out=storage)
    else:
        storage.copy_(torch.where(mask, new, storage))


def assign(storage, value):
    value = unwrap(value)
    mask = _MASK.get()
    with torch.no_grad():
        if mask is not None:
            select_into(storage, mask, value)
        elif isinstance(value, torch.Tensor):
            storage.copy_(value)
        else:
            storage.fill_(value)
    return storage


def assign_add(storage, value):
    value = unwrap(value)
    mask = _MASK.get()
    with torch.no_grad():
        if mask is not None:
            select_into(storage, mask, storage + value)
        else:
            storage.add_(value)
    return storage


def assign_sub(storage, value):
    value = unwrap(value)
    mask = _MASK.get()
    with torch.no_grad():
        if mask is not None:
            select_into(storage, mask, storage - value)
        else:
            storage.sub_(value)
    return storage


def cast(x, dtype):
    x = unwrap(x)
    if isinstance(x, torch.Tensor):
        return x.to(_dtype(dtype))
    return torch.as_tensor(x, dtype=_dtype(dtype))


def _t(x):
    x = unwrap(x)
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _unary(fn):
    return lambda x: fn(_t(x))


sqrt = _unary(torch.sqrt)
square = _unary(torch.square)
abs = _unary(torch.abs)  # noqa: A001 - the seam's name for |x|
sign = _unary(torch.sign)
exp = _unary(torch.exp)
log = _unary(torch.log)
cos = _unary(torch.cos)
floor = _unary(torch.floor)
isfinite = _unary(torch.isfinite)
logical_not = _unary(torch.logical_not)


# Python numbers met in arithmetic become 0-d tensors made on the device by
# a fill (`torch.full`), never copied from the host: a host-to-device copy of
# pageable memory waits for the device. Each is made once per (value,
# dtype, device) and only ever read.
_CONSTANTS = {}


def constant(value, dtype, device):
    """A cached 0-d tensor holding the Python number `value`."""
    if torch.compiler.is_compiling():
        # The compiler folds constants itself (and cannot trace `repr`).
        return torch.full((), value, dtype=dtype, device=device)
    key = (type(value), repr(value), dtype, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        tensor = _CONSTANTS[key] = torch.full((), value, dtype=dtype, device=device)
    return tensor


def _pair(x, y):
    x, y = unwrap(x), unwrap(y)
    if not isinstance(x, torch.Tensor):
        if not isinstance(y, torch.Tensor):
            x = torch.as_tensor(x)
        else:
            x = _like(x, y)
    if not isinstance(y, torch.Tensor):
        y = _like(y, x)
    return x, y


def _like(value, tensor):
    if isinstance(value, numbers.Number):
        return constant(value, tensor.dtype, tensor.device)
    return torch.as_tensor(value, dtype=tensor.dtype, device=tensor.device)


def power(x, y):
    return torch.pow(*_pair(x, y))


def maximum(x, y):
    return torch.maximum(*_pair(x, y))


def minimum(x, y):
    return torch.minimum(*_pair(x, y))


def logical_and(x, y):
    return torch.logical_and(*_pair(x, y))


def where(cond, x, y):
    x, y = _pair(x, y)
    return torch.where(_t(cond), x, y)


def clip(x, lo, hi):
    return torch.clamp(_t(x), lo, hi)


def sum(x):  # noqa: A001
    return torch.sum(_t(x))


def all_max(x, group=None):
    """The maximum of scalar `x` over the ranks of `group` (the default group if None).

    Does nothing unless torch.distributed is initialised with more than one
    rank. One small all-reduce; with NCCL it is queued on the device stream
    like any kernel, so it adds no host synchronisation.
    """
    x = unwrap(x)
    if not _several_ranks(group):
        return x
    reduced = x.detach().to(torch.float32).clone()
    torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX, group=group)
    return reduced.to(x.dtype)


def all_true(flag, group=None):
    """Whether boolean scalar `flag` holds on every rank of `group` (see `all_max`)."""
    flag = unwrap(flag)
    if not _several_ranks(group):
        return flag
    reduced = flag.detach().to(torch.float32).clone()
    torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MIN, group=group)
    return reduced > 0


def _several_ranks(group):
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(
                "`process_group` was given but torch.distributed is not "
                f"initialised. Received: process_group={group!r}"
            )
        return False
    return dist.get_world_size(group) > 1


def cond(pred, true_fn, false_fn, variables):
    """Runs `true_fn` where `pred` holds and `false_fn` where it does not.

    A Python (or NumPy) boolean takes a plain `if`. A tensor is never read on
    the host: both branches run, under masks `outer & pred` and
    `outer & ~pred`, and the masked writes keep what the branch not taken
    would have stored out of every variable. `variables` is part of the seam
    (JAX needs it); writes find their masks without it here.
    """
    pred = unwrap(pred)
    if not isinstance(pred, torch.Tensor):
        true_fn() if bool(pred) else false_fn()
        return
    pred = pred.to(torch.bool)
    outer = _MASK.get()
    if outer is not None:
        pred = mask_on(pred, outer.device)
    with masked(pred if outer is None else outer & pred):
        true_fn()
    with masked(~pred if outer is None else outer & ~pred):
        false_fn()


def quiet():
    return contextlib.nullcontext()
