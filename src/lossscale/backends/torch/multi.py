"""torch's multi-tensor unscale, finite check and norms (part of `ops`).

Every function takes a list of tensors, splits it by (device, dtype), and
runs one multi-tensor kernel per group; results stay on the device. On CPU,
where torch's multi-tensor reductions are slow generic loops, the finite
check takes other routes (see `_cpu_flags`).
"""

import threading

import torch

from lossscale.backends._common import unwrap


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


# The last CPU `unscale` result, by id, kept alive until the next call.
# - Freed at once, hundreds of MiB of gradients go back to the OS and the
#   next step faults every page in again (about 9x the cost of the division
#   itself with glibc); held one step longer, the allocator reuses them.
#   CUDA's caching allocator needs no such help.
# - `all_finite` checks these tensors, which nobody else has seen, with
#   torch's check-and-unscale kernel at scale 1, in place: multiplying by
#   exactly 1 leaves every value as it is, and on CPU that kernel is several
#   times faster than any reduction that leaves its input alone.
_RECENT_CPU_RESULT = {}


def unscale(grads, scale):
    grads = [unwrap(g) for g in grads]
    if not grads:
        return []
    scale = unwrap(scale)
    parts = groups(grads)
    out = [None] * len(grads)
    for device, dtype, indices in parts:
        group = [grads[i] for i in indices]
        if dtype.itemsize < 4:
            # Half gradients are unscaled in float32: the copy is ours, so
            # the division can run in place on it.
            group = [g.float() for g in group]
            torch._foreach_div_(group, scale.to(device=device, dtype=torch.float32))
        else:
            group = torch._foreach_div(group, scale.to(device=device, dtype=dtype))
        if len(parts) == 1:
            out = list(group)
            break
        for i, g in zip(indices, group):
            out[i] = g
    # Not while torch.compile traces: an `id` would guard every step's fresh
    # gradients by identity and recompile each time. A result inside an
    # autograd graph is not checked in place: that would break its backward.
    if out[0].device.type == "cpu" and not torch.compiler.is_compiling():
        _RECENT_CPU_RESULT.clear()
        _RECENT_CPU_RESULT.update((id(g), g) for g in out if not g.requires_grad)
    return out


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
    # torch's multi-tensor inf-norm is a slow generic reduction on CPU.
    recent = {} if torch.compiler.is_compiling() else _RECENT_CPU_RESULT
    ours = [a for a in group if recent.get(id(a)) is a]
    others = [a for a in group if recent.get(id(a)) is not a] if len(ours) < len(group) else []
    flags = []
    if ours:
        found = torch.zeros(1, dtype=torch.float32)
        torch._amp_foreach_non_finite_check_and_unscale_(ours, found, torch.ones(()))
        flags.append(found[0] == 0)
    if others:
        # Min and max of each tensor, in one pass each.
        extremes = torch.stack([x for a in others for x in torch.aminmax(a)])
        flags.append(torch.isfinite(extremes).all())
    return flags


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
    # Multi-tensor reductions per group and a small one on top: the flag
    # stays on the device. Each group is tested in its own dtype, so a large
    # finite float64 value is not mistaken for an overflow; NaN propagates
    # through both reductions.
    return _combine(_group_flags(arrays)).all()


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


# CPU tensors under this many elements are copied into one buffer and reduced
# there at once: with hundreds of small gradients, one reduction call per
# tensor costs several times the bytes it reads (on 400 tensors holding 1M
# floats, 0.8 ms against 0.3 ms packed). Larger ones are reduced in place.
PACK_BELOW = 1 << 16
# At most this many elements are packed (16 MiB of float32): the buffer is
# memory kept between steps, and past a few million elements the calls it
# saves no longer matter.
PACK_CAPACITY = 1 << 22
# Packing buffers by (dtype, shapes), one set per thread (two threads may
# check gradients of the same shapes at once); the last few kept.
_PACKS = threading.local()
_PACKS_KEPT = 4


def _cpu_peak(group):
    """Largest |x| over one CPU (dtype) group, as a float32 scalar; NaN if any NaN."""
    # torch's inf-norm is a slow generic reduction on CPU; min and max in one
    # pass are not (NaN propagates through both).
    small, reduced, packed = [], [], 0
    for a in group:
        n = a.numel()
        if n < PACK_BELOW and packed + n <= PACK_CAPACITY:
            small.append(a)
            packed += n
        else:
            reduced.append(a)
    if len(small) > 1 and not torch.compiler.is_compiling():
        reduced.append(_packed(small))
    else:
        reduced += small
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
        entry = (
            flat,
            [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)],
        )
        while len(packs) >= _PACKS_KEPT:
            packs.pop(next(iter(packs)))
    packs[key] = entry  # most recently used last
    flat, views = entry
    with torch.no_grad():
        torch._foreach_copy_(views, tensors)
    return flat
