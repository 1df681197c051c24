"""PyTorch backend.

A `Variable` wraps a user's tensor or `nn.Parameter` without copying; reads
go through `.detach()` so optimizer arithmetic never records autograd history,
and writes are in place so the user's module sees every update.

Scalars an optimizer creates (learning rate, iterations, loss scale) live on
the device of the first variable it was built with, so a step needs no
host round trip.
"""

import contextlib

import torch

from lossscale.backends._common import unwrap

NAME = "torch"
MUTABLE = True
INT_DTYPE = "int64"


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


def assign(storage, value):
    value = unwrap(value)
    with torch.no_grad():
        if isinstance(value, torch.Tensor):
            storage.copy_(value)
        else:
            storage.fill_(value)
    return storage


def assign_add(storage, value):
    with torch.no_grad():
        storage.add_(unwrap(value))
    return storage


def assign_sub(storage, value):
    with torch.no_grad():
        storage.sub_(unwrap(value))
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


def _pair(x, y):
    x, y = unwrap(x), unwrap(y)
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x, dtype=y.dtype if isinstance(y, torch.Tensor) else None,
                            device=_device(y))
    if not isinstance(y, torch.Tensor):
        y = torch.as_tensor(y, dtype=x.dtype, device=x.device)
    return x, y


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


def unscale(grads, scale):
    scale = unwrap(scale)
    out = []
    for g in grads:
        g = unwrap(g)
        if g.dtype.itemsize < 4:
            g = g.float()
        out.append(g / scale.to(device=g.device, dtype=g.dtype))
    return out


def all_finite(arrays):
    arrays = [unwrap(a) for a in arrays]
    if not arrays:
        return torch.tensor(True)
    # One reduction per tensor, combined on device: no host round trip.
    flags = [torch.isfinite(a).all() for a in arrays]
    return torch.stack([f.to(flags[0].device) for f in flags]).all()


def global_norm(arrays):
    arrays = [unwrap(a) for a in arrays]
    norms = torch._foreach_norm([a.float() if a.dtype.itemsize < 4 else a for a in arrays])
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def max_abs(arrays):
    """Largest |x| over all arrays as a float32 scalar (NaN if any NaN)."""
    arrays = [unwrap(a) for a in arrays]
    norms = torch._foreach_norm(arrays, float("inf"))
    return torch.stack([n.float().to(norms[0].device) for n in norms]).max()


# Fused multi-tensor kernels, keyed by the exact optimizer class they
# reproduce. Each entry has a test proving it equals `update_step`.
FUSED_KERNELS = {}


def fused_update(optimizer):
    return FUSED_KERNELS.get(type(optimizer))


def cond(pred, true_fn, false_fn, variables):
    pred = unwrap(pred)
    if not isinstance(pred, torch.Tensor) or pred.device.type == "cpu":
        # Reading a CPU tensor is not a device synchronisation.
        true_fn() if bool(pred) else false_fn()
        return
    # On an accelerator, run both branches and select on device: no sync.
    originals = [v._storage.detach().clone() for v in variables]
    true_fn()
    taken = [v._storage.detach().clone() for v in variables]
    for v, o in zip(variables, originals):
        v._storage.detach().copy_(o)
    false_fn()
    with torch.no_grad():
        for v, t in zip(variables, taken):
            s = v._storage.detach()
            s.copy_(torch.where(pred.to(s.device), t, s))


def quiet():
    return contextlib.nullcontext()
