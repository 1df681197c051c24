"""torch's multi-tensor unscale, finite check and norms (part of `ops`).

Every function takes a list of tensors, splits it by (device, dtype), and
runs one multi-tensor kernel per group; results stay on the device. On CPU,
where torch's multi-tensor reductions are slow generic loops, the finite
check takes other routes (see `_cpu_flags`).
"""

import math
import operator
import threading

import torch

from lossscale.backends._common import unscale_then_check, unwrap
from lossscale.backends.torch import dtensors, layout, ops


def groups(tensors):
    """Splits `tensors` by (device, dtype): `[(device, dtype, indices), ...]`.

    torch's multi-tensor kernels take one device and one dtype per call.
    """
    first = tensors[0]
    device, dtype = first.device, first.dtype
    if all(t.dtype == dtype and t.device == device for t in tensors):
        return [(device, dtype, range(len(tensors)))]
    found = {}
    for i, t in enumerate(tensors):
        found.setdefault((t.device, t.dtype), []).append(i)
    return [(device, dtype, indices) for (device, dtype), indices in found.items()]


# The last CPU `unscale` copies, kept alive until the next call: freed at once, hundreds
# of MiB go back to the OS and the next step faults every page in again (about 9x the
# division's cost with glibc); held a step longer, the allocator reuses them (CUDA's
# caching allocator needs no such help).
_RECENT_CPU_COPIES = []


def unscale(grads, scale, in_place=False):
    """`grads` divided by `scale` (float32 results for half gradients).

    Args:
        grads: Tensors.
        scale: The loss scale, a 0-d tensor.
        in_place: Whether float32/float64 gradients may be divided in their
            own memory (the caller owns them): no new full-size tensors.
            Half gradients are always unscaled into float32 copies, and so is
            a group holding a gradient of an autograd graph (writing into it
            would break its backward) or one tensor twice.
    """
    grads = [unwrap(g) for g in grads]
    if not grads:
        return []
    scale = unwrap(scale)
    parts = groups(grads)
    out = [None] * len(grads)
    copies = []
    for device, dtype, indices in parts:
        group = [grads[i] for i in indices]
        if dtype.itemsize < 4:
            # Half gradients are unscaled in float32 copies: ours to divide in place.
            group = [g.float() for g in group]
            torch._foreach_div_(group, scale.to(device=device, dtype=torch.float32))
            copies.extend(group)
        elif in_place and _writable(group):
            torch._foreach_div_(group, scale.to(device=device, dtype=dtype))
        else:
            group = torch._foreach_div(group, scale.to(device=device, dtype=dtype))
            copies.extend(group)
        if len(parts) == 1:
            out = list(group)
            break
        for i, g in zip(indices, group):
            out[i] = g
    if copies and copies[0].device.type == "cpu" and not torch.compiler.is_compiling():
        _RECENT_CPU_COPIES[:] = copies
    return out


_requires_grad = operator.attrgetter("requires_grad")


def _writable(tensors):
    """Whether each of `tensors` may be divided in place.

    Not part of an autograd graph, none given twice, none sharing memory
    (`layout.own_memory`: an expanded gradient cannot be written in place,
    and overlapping views would be divided twice). Not while `torch.compile`
    traces: it fuses the division anyway, and the identity check would guard
    on every step's fresh gradient objects.
    """
    if torch.compiler.is_compiling():
        return False
    return (
        not any(map(_requires_grad, tensors))
        and len(set(map(id, tensors))) == len(tensors)
        and layout.own_memory(tensors)
    )


def finite_flags(arrays):
    """Whether every element of `arrays` is finite, as `(finite, skip)`.

    `finite` is a boolean 0-d tensor, `skip` the same flag in torch's AMP form
    (float32, 1.0 where not finite: the fused kernels' `found_inf`). One AMP check
    per (device, dtype) group at scale 1, which stores every value it reads back
    unchanged: `arrays` must be the caller's own to write.
    """
    arrays = _floats(arrays)
    if not arrays:
        return torch.tensor(True), torch.zeros(())
    if torch.compiler.is_compiling():
        # The compiler fuses these reductions into the loops that wrote `arrays` (the AMP
        # kernel would be opaque). Small arrays are concatenated first: Inductor opens a
        # parallel region per reduction. Chained with `&`, not stacked: one 0-d buffer per
        # reduction, where a stack cost two buffer calls per reduction and one more.
        finite = None
        for _, _, indices in groups(arrays):
            group = [arrays[i] for i in indices]
            small, large = split_small(group)
            parts = [group[i] for i in large]
            if len(small) > 1:
                parts.append(torch.cat([group[i].reshape(-1) for i in small]))
            else:
                parts += [group[i] for i in small]
            for part in parts:
                flag = torch.isfinite(part).all()
                finite = flag if finite is None else finite & flag.to(finite.device)
        return finite, (~finite).to(torch.float32)
    skip = None
    for device, _, indices in groups(arrays):
        skip = _either(skip, _amp_check([arrays[i] for i in indices], 1.0, device))
    return skip == 0, skip


def unscale_checked(grads, scale, in_place=False):
    """`(unscaled, finite, skip)`: `unscale(grads, scale, in_place)` and its `finite_flags`.

    In one pass where that is exact: torch's AMP kernel multiplies by `1 / scale`
    and flags non-finite values it reads, which is the division bit for bit for a
    power-of-two scale up to 2**126, and cannot overflow for a scale of at least 1.
    The scale is read on the host only on the CPU (no wait). Otherwise (compiled, a
    device or other scale, gradients not the caller's to write) they are divided
    and then checked, which catches a gradient that overflows only when divided.
    """
    grads = [unwrap(g) for g in grads]
    parts = groups(grads) if grads else ()
    if (
        not parts
        or any(
            dtype.itemsize >= 4 and not (in_place and _writable([grads[i] for i in indices]))
            for _, dtype, indices in parts
        )
        or (inverse := _exact_inverse(unwrap(scale))) is None
    ):
        return unscale_then_check(unscale, finite_flags, grads, scale, in_place)
    out = [None] * len(grads) if len(parts) > 1 else None
    copies, skip = [], None
    for device, dtype, indices in parts:
        group = [grads[i] for i in indices]
        if dtype.itemsize < 4:  # unscaled into float32 copies, as `unscale` does
            group = [g.float() for g in group]
            copies.extend(group)
        # The CPU kernel takes empty tensors as they are.
        skip = _either(skip, _amp_check(group, inverse, device))
        if len(parts) == 1:
            out = group
        else:
            for i, g in zip(indices, group):
                out[i] = g
    if copies:
        _RECENT_CPU_COPIES[:] = copies
    return out, skip == 0, skip


def checks_while_unscaling():
    """Whether `unscale_checked` runs torch's one-pass AMP kernel: eagerly, not traced."""
    return not torch.compiler.is_compiling()


# Device types whose scalars a step may read on the host: the value is in
# host memory, so reading it waits for nothing. Never a GPU.
HOST_READABLE = frozenset({"cpu"})


def _exact_inverse(scale):
    """`1 / scale` where multiplying by it divides exactly and cannot overflow, else None.

    Only for a 0-d tensor on a `HOST_READABLE` device, outside `torch.compile`: a
    power of two from 1 to 2**126, whose inverse is a normal float32.
    """
    if (
        not isinstance(scale, torch.Tensor)
        or scale.device.type not in HOST_READABLE
        or scale.ndim != 0
        or torch.compiler.is_compiling()
    ):
        return None
    value = scale.item()
    if math.frexp(value)[0] != 0.5 or not 1.0 <= value <= 2.0**126:
        return None
    return 1.0 / value


def _amp_check(tensors, inverse, device):
    """torch's AMP kernel on one group (`tensors *= inverse`): 1.0 where a value was not finite."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, found, ops.constant(inverse, torch.float32, device)
        )
    except NotImplementedError:
        # Asked only here, on failure: a layout test per gradient per step
        # would cost microseconds on every step.
        sparse = [t for t in tensors if t.layout != torch.strided]
        if not sparse:
            raise
        raise ValueError(
            "lossscale's optimizers take dense torch gradients. For a sparse one (an "
            "nn.Embedding(sparse=True)'s), use lossscale.torch.GradScaler with a torch "
            "optimizer that takes it (SGD, SparseAdam, Adagrad), or a dense embedding. "
            f"Received: a {sparse[0].layout} gradient of shape {tuple(sparse[0].shape)}"
        ) from None
    return found


def _either(skip, found):
    return found if skip is None else torch.maximum(skip, found.to(skip.device))


def _floats(arrays):
    arrays = [unwrap(a) for a in arrays]
    return [a for a in arrays if a.is_floating_point() and a.numel()]


def _group_flags(arrays):
    """For each (device, dtype) group, a 0-d flag: every element finite."""
    flags = []
    for device, _, indices in groups(arrays):
        group = [arrays[i] for i in indices]
        if device.type == "cpu":
            flags.extend(_cpu_flags(group))
        else:
            flags.append(
                torch.isfinite(torch.stack(torch._foreach_norm(group, float("inf")))).all()
            )
    return flags


def _cpu_flags(group):
    # torch's multi-tensor inf-norm is a slow generic reduction on CPU; min
    # and max of each tensor take one pass each, and leave it untouched.
    # Tested in the group's own dtype: a large float64 is not an overflow.
    extremes = torch.stack([x for a in group for x in torch.aminmax(a)])
    return [torch.isfinite(extremes).all()]


def _combine(scalars):
    """Stacks 0-d results of several groups on the first one's device."""
    if len(scalars) == 1:
        return scalars[0].reshape(1)
    device = scalars[0].device
    return torch.stack([s.to(device) for s in scalars])


def all_finite(arrays):
    arrays = _floats(arrays)
    if not arrays:
        return torch.tensor(True)
    # Per-group reductions on the device, each in its own dtype (a large float64 is
    # no overflow); NaN propagates through both reductions.
    return _combine(_group_flags(arrays)).all()


def peaks(tensors):
    """Each tensor's largest |x| (NaN where it holds a NaN), a 0-d tensor of its dtype.

    One multi-tensor inf-norm per (device, dtype) group on an accelerator.
    On CPU that norm is a slow generic reduction (about 7x a 2-norm); min
    and max in one pass (`aminmax`) give the same values, bit for bit.
    """
    found = [None] * len(tensors)
    for device, _, indices in groups(tensors):
        group = [tensors[i] for i in indices]
        if device.type == "cpu" and not dtensors.is_dtensor(group[0]):
            lows, highs = zip(*map(torch.aminmax, group))
            if len(group) == 1:
                values = [torch.maximum(highs[0], -lows[0])]
            else:  # one dispatch per operation, not per tensor
                values = torch.maximum(torch.stack(highs), -torch.stack(lows)).unbind()
        else:
            values = torch._foreach_norm(group, math.inf)
        for i, value in zip(indices, values):
            found[i] = value
    return found


def global_norm(arrays):
    arrays = [unwrap(a) for a in arrays]
    arrays = [a.float() if a.dtype.itemsize < 4 else a for a in arrays]
    norms = []
    for _, _, indices in groups(arrays):
        norms.extend(torch._foreach_norm([arrays[i] for i in indices]))
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def max_abs(arrays):
    """Largest |x| over all arrays as a float32 scalar (NaN if any NaN)."""
    arrays = _floats(arrays)
    if not arrays:
        return torch.tensor(0.0)
    peaks = []
    for device, _, indices in groups(arrays):
        group = [arrays[i] for i in indices]
        if device.type == "cpu":
            peaks.append(_cpu_peak(group))
        else:
            peaks.append(torch.stack(torch._foreach_norm(group, float("inf"))).max().float())
    return peaks[0] if len(peaks) == 1 else _combine(peaks).max()


def finite_unscaled(arrays, scale):
    """Whether every element of `arrays`, divided by `scale`, is finite.

    Division is monotone: the largest magnitude over the scale decides.
    """
    return torch.isfinite(max_abs(arrays) / unwrap(scale))


# CPU tensors under this many elements are copied into one buffer and reduced
# there at once: with hundreds of small gradients, one reduction call per
# tensor costs several times the bytes it reads (on 400 tensors holding 1M
# floats, 0.8 ms against 0.3 ms packed). Larger ones are reduced in place.
PACK_BELOW = 1 << 16
# At most this many elements are packed (16 MiB of float32): the buffer is kept between
# steps, and past a few million elements the calls it saves no longer matter.
PACK_CAPACITY = 1 << 22
# Packing buffers by (dtype, shapes), one set per thread (two threads may
# check gradients of the same shapes at once); the last few kept.
_PACKS = threading.local()
_PACKS_KEPT = 4


def split_small(tensors):
    """`(small, large)`: the positions of the tensors to pack together, and of the others.

    Tensors under `PACK_BELOW` elements, in order, while the packed total
    stays within `PACK_CAPACITY`. The one packing rule of the backend: the
    finite check's peak and `plans.Writer`'s selects both follow it.
    """
    small, large, packed = [], [], 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if n < PACK_BELOW and packed + n <= PACK_CAPACITY:
            small.append(i)
            packed += n
        else:
            large.append(i)
    return small, large


def _cpu_peak(group):
    """Largest |x| over one CPU (dtype) group, as a float32 scalar; NaN if any NaN."""
    # Not torch's slow CPU inf-norm: min and max in one pass (NaN propagates through both).
    positions, others = split_small(group)
    small, reduced = [group[i] for i in positions], [group[i] for i in others]
    if len(small) < 2 or dtensors.is_dtensor(small[0]):
        reduced += small
    elif torch.compiler.is_compiling():
        # Concatenated as `finite_flags` does while tracing: Inductor's CPU
        # code opens a parallel region per reduction (no buffer kept there).
        reduced.append(torch.cat([t.reshape(-1) for t in small]))
    else:
        reduced.append(_packed(small))
    extremes = torch.stack([x for a in reduced for x in torch.aminmax(a)])
    return extremes.float().abs().max()


def _packed(tensors):
    """`tensors` copied, in order, into one flat buffer kept for their shapes."""
    packs = getattr(_PACKS, "by_key", None)
    if packs is None:
        packs = _PACKS.by_key = {}
    # A buffer made under inference mode cannot be written outside it.
    key = (tensors[0].dtype, torch.is_inference_mode_enabled(), tuple(t.shape for t in tensors))
    entry = packs.pop(key, None)
    if entry is None:
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
        views = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
        entry = (flat, views)
        while len(packs) >= _PACKS_KEPT:
            packs.pop(next(iter(packs)))
    packs[key] = entry  # most recently used last
    flat, views = entry
    with torch.no_grad():
        torch._foreach_copy_(views, tensors)
    return flat
