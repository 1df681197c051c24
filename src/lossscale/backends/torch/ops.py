"""PyTorch backend.

A `Variable` wraps a user's tensor or `nn.Parameter` without copying: reads
are detached, writes in place. An optimizer's scalars live on its first
variable's device, so a step needs no host round trip.
"""

import numbers

import torch

from lossscale.backends._common import unwrap
from lossscale.backends.torch import dtensors, layout

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


def records_calls():
    """Whether a front end may keep Python-side records of this call (see the protocol)."""
    return not torch.compiler.is_compiling()


def host_control():
    """Whether a Python branch in a step is taken anew at each call: eager, not compiling."""
    return not torch.compiler.is_compiling()


def asarray(x, dtype=None, like=None):
    x = unwrap(x)
    device = _device(like)
    if isinstance(x, torch.Tensor):
        out = x.to(device=device or x.device, dtype=_dtype(dtype) if dtype else x.dtype)
    elif hasattr(x, "__array__") and not isinstance(x, (int, float, bool)):
        import numpy as np

        x = torch.as_tensor(np.asarray(x))
        out = x.to(device=device or "cpu", dtype=_dtype(dtype) if dtype else x.dtype)
    else:
        out = torch.as_tensor(x, dtype=_dtype(dtype) if dtype else None, device=device)
    return _placed_like(out, like)


def full(shape, value, dtype, like=None):
    out = torch.full(tuple(shape), value, dtype=_dtype(dtype), device=_device(like))
    return _placed_like(out, like)


def _placed_like(tensor, like):
    """`tensor` sharded or laid out as the parameter `like` it is state of (fused kernels)."""
    like = dtensors.seen(unwrap(like))
    if not isinstance(like, torch.Tensor) or tuple(tensor.shape) != tuple(like.shape):
        return tensor
    if dtensors.is_dtensor(like):
        return tensor if dtensors.is_dtensor(tensor) else dtensors.shard_like(tensor, like)
    if tensor.stride() != like.stride() and layout.dense(like):
        return layout.laid_out_as(tensor, like)
    return tensor


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
    # A parameter's reads must not record autograd history; state needs no alias.
    return storage.detach() if storage.requires_grad else storage


def _records(storage, value):
    """Whether autograd would record an in-place write (only then is `no_grad` worth its cost)."""
    return torch.is_grad_enabled() and (
        storage.requires_grad or (isinstance(value, torch.Tensor) and value.requires_grad)
    )


def _write(write, storage, value):
    """`write(value)`, an in-place method of `storage`, under `no_grad` only where needed."""
    if _records(storage, value):
        with torch.no_grad():
            write(value)
    else:
        write(value)
    return storage


def assign(storage, value):
    value = unwrap(value)
    if dtensors.is_dtensor(value) and not dtensors.is_dtensor(storage):
        # A replicated DTensor result stored in plain state (telemetry).
        value = dtensors.plain(value)
    write = storage.copy_ if isinstance(value, torch.Tensor) else storage.fill_
    return _write(write, storage, value)


def assign_add(storage, value):
    return _write(storage.add_, storage, unwrap(value))


def assign_sub(storage, value):
    return _write(storage.sub_, storage, unwrap(value))


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


def _binary(fn):
    return lambda x, y: fn(*_pair(x, y))


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


# Python numbers met in arithmetic become 0-d tensors filled on the device
# (a host copy would wait for it), once per (value, dtype, device); the oldest
# go first past _CONSTANTS_KEPT (a scheduler may move a value every step).
_CONSTANTS = {}
_CONSTANTS_KEPT = 1024


def constant(value, dtype, device):
    """A cached 0-d tensor holding the Python number `value` (a 1-d one for a tuple)."""
    if torch.compiler.is_compiling():
        # The compiler folds constants itself (and cannot trace `repr`).
        return _make_constant(value, dtype, device)
    key = (type(value), repr(value), dtype, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        if len(_CONSTANTS) >= _CONSTANTS_KEPT:
            del _CONSTANTS[next(iter(_CONSTANTS))]
        tensor = _CONSTANTS[key] = _make_constant(value, dtype, device)
    return tensor


def _make_constant(value, dtype, device):
    if isinstance(value, tuple):  # copied from the host once, then cached
        return torch.tensor(value, dtype=dtype, device=device)
    return torch.full((), value, dtype=dtype, device=device)


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


power = _binary(torch.pow)
maximum = _binary(torch.maximum)
minimum = _binary(torch.minimum)
logical_and = _binary(torch.logical_and)


def where(cond, x, y):
    x, y = _pair(x, y)
    return torch.where(_t(cond), x, y)


def clip(x, lo, hi):
    return torch.clamp(_t(x), lo, hi)


def stack(values):
    """The scalar tensors `values` as one vector, on the first one's device (no host wait)."""
    if type(values[0]) is torch.Tensor:
        try:  # plain tensors on one device (the state's fields): one dispatch
            return torch.stack(values)
        except (TypeError, RuntimeError):
            pass
    values = [dtensors.plain(_t(v)) for v in values]
    device = values[0].device
    return torch.stack([v.to(device, non_blocking=True) for v in values])


def unstack(x):
    """The entries of the vector `x`, as 0-d views (one dispatch)."""
    return x.unbind()


def sum(x):  # noqa: A001
    return torch.sum(_t(x))


def all_max(x, group=None):
    """The maximum of `x` (elementwise; NaN where any rank's is) over the ranks of `group`.

    One small all-reduce, without host synchronisation on NCCL; nothing
    unless several ranks run.
    """
    x = unwrap(x)
    if not several_participants(group):
        return x
    x = dtensors.plain(x)  # torch.distributed's collectives refuse DTensors
    values = x.detach().to(torch.float32)
    # MAX may drop a rank's NaN: whether any rank held one travels beside.
    both = torch.stack([values, values.isnan().to(torch.float32)])
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=group)
    return torch.where(both[1] > 0, float("nan"), both[0]).to(x.dtype)


def all_true(flag, group=None):
    """Whether boolean scalar `flag` holds on every rank of `group` (see `all_max`)."""
    flag = unwrap(flag)
    if not several_participants(group):
        return flag
    flag = dtensors.plain(flag)  # torch.distributed's collectives refuse DTensors
    reduced = flag.detach().to(torch.float32).clone()
    torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MIN, group=group)
    return reduced > 0


def all_gather(x, group=None):
    """`x` of every rank of `group`, stacked along a new first axis (one collective)."""
    x = unwrap(x)
    if not several_participants(group):
        return x[None]
    x = dtensors.plain(x).detach().contiguous()
    out = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(out, x, group=group)
    return torch.stack(out)


def several_participants(group=None):
    """Whether torch.distributed runs with more than one rank in `group`."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(
                "`process_group` was given but torch.distributed is not "
                f"initialised. Received: process_group={group!r}"
            )
        return False
    return dist.get_world_size(group) > 1


def quiet():
    # Also where a step's plain scalars meet DTensors (see `dtensors`).
    return dtensors.replicating()
