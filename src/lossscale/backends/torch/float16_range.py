"""The float16 range of many gradients at once, in a fixed number of operations.

`mixed_precision.diagnostics.measure` reduces one gradient at a time: about
thirty dispatched operations each, 5 ms for `tiny`'s 28 gradients on CPU.
`measure` here gives the same four numbers per gradient, bit for bit, in
about fifteen operations for any number of gradients:

- every gradient is copied, as float32, into one flat buffer, and made
  non-negative there (`abs`);
- each element's class (0: zero, 1: float16 subnormal, 2: normal, 3: near
  float16's maximum or inf, 4: NaN) is read off its float32 bit pattern,
  which for non-negative floats orders as the values do (NaN's patterns
  lie above inf's): the class is the sum of four integer steps
  `clamp(bits - k, 0, 1)`, several times faster on CPU than comparisons
  into booleans or `torch.bucketize`;
- the class plus five times the gradient's index is counted into one
  integer histogram (`index_add_`: no host read, where `bincount` reads its
  input's maximum on CUDA);
- the counts are divided by the sizes and the largest magnitudes come
  from `torch._foreach_max`: one `(n, 4)` table, whose columns are the
  four vectors;
- on a device whose memory the host reads without waiting (the CPU:
  `multi.HOST_READABLE`), NumPy builds the same table instead, in the
  buffers' own memory, counting only the classes present (`_host_counts`):
  `measure` of `tiny`'s 28 gradients takes 0.10 ms and of `gpt`'s 29 (1.0M
  elements) 0.41 ms, where counting every class by sums took 0.29 and 1.2,
  and the histogram on the CPU 0.38 and 4.1.

Gradients of `multi.PACK_BELOW` elements or more (or past
`multi.PACK_CAPACITY` packed: the finite check's packing rule) are measured
alone, `multi.PACK_CAPACITY` elements at a time through one kept scratch
buffer (their counts summed, their peaks compared), so no buffer kept
between steps grows past `multi.PACK_CAPACITY` elements, and measuring a
gradient of any size takes no memory in proportion to it (a copy of a
50M-element gradient and the histogram's two integer arrays of its size
were 600 MB).
"""

import struct
import threading
from typing import NamedTuple

import numpy as np
import torch

from lossscale.backends.torch import dtensors, multi

# Buffers by (device, inference mode, shapes), one set per thread; the last few kept.
_BUFFERS = threading.local()
_BUFFERS_KEPT = 4
# Classes per gradient in the histogram: zero, subnormal, normal, near, NaN.
_CLASSES = 5
# A class with fewer members than 1 in this many elements is counted member
# by member (`_per_tensor`), else by sums over every element.
_SPARSE_BELOW = 16


def _bits(x):
    """The bit pattern of the float32 nearest `x`, as an int."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


_INF_BITS = _bits(float("inf"))


def measure(grads, subnormal_below, near_from):
    """The float16 range of each of `grads`, as four vectors.

    Args:
        grads: Floating-point tensors, each with at least one element.
        subnormal_below: Magnitudes under it (and above 0) count as subnormal.
        near_from: Magnitudes from it on (inf included) count as near the
            maximum.

    Returns:
        `(zero, subnormal, near_max, max_abs)`, float32 vectors whose entry
        i is `grads[i]`'s; None where these gradients are not measured here
        (DTensors, gradients on several devices, inside `torch.compile`,
        whose graph fuses the per-gradient measurement itself).
    """
    if (
        not grads
        or torch.compiler.is_compiling()
        or any(map(dtensors.is_dtensor, grads))
        or len({g.device for g in grads}) > 1
    ):
        return None
    # Magnitudes compared as bit patterns (`_Edges`); thresholds as float32, as in `measure`.
    edges = _Edges(_bits(subnormal_below), _bits(near_from), _INF_BITS)
    packed, alone = _chunks(grads)
    with torch.no_grad():
        if grads[0].device.type in multi.HOST_READABLE:
            table = _measured_on_the_host(grads, packed, alone, edges)
        else:
            table = _measured_on_the_device(grads, packed, alone, edges)
    return table.unbind(1)


class _Edges(NamedTuple):
    """The classes' bounds, as float32 bit patterns of magnitudes."""

    subnormal: int  # from 1 up to (not including) it: subnormal
    near: int  # from it up to `inf` (included): near the maximum
    inf: int  # above it: NaN


def _chunks(grads):
    """(indices packed into one buffer, indices measured alone), in order."""
    packed, alone = multi.split_small(grads)
    if len(packed) == 1:
        return [], packed + alone
    return packed, alone


def _magnitudes(grads, packed):
    """`(flat float32 magnitudes of grads[packed], their _Buffers)`, in a kept buffer."""
    buffers = _buffers([grads[i] for i in packed])
    torch._foreach_copy_(buffers.views, [grads[i] for i in packed])  # float32, as `measure`
    return buffers.flat.abs_(), buffers  # the views now hold the magnitudes


def _magnitude_chunks(grad):
    """The float32 magnitudes of one gradient, `multi.PACK_CAPACITY` elements at a time.

    Each chunk overwrites the last in the one scratch buffer (its consumers run before
    the next is written: on the host at once, on a GPU in stream order).
    """
    flat = _flat(grad)
    size = flat.numel()
    scratch = _scratch(grad.device, min(size, multi.PACK_CAPACITY))  # at least that many
    for start in range(0, size, multi.PACK_CAPACITY):
        part = flat[start : start + multi.PACK_CAPACITY]
        magnitudes = scratch[: part.numel()]
        if part.dtype == torch.float32:
            torch.abs(part, out=magnitudes)  # read once
        else:  # `abs` writes only its input's dtype
            magnitudes.copy_(part).abs_()
        yield magnitudes


def _flat(grad):
    """`grad`'s elements as one dimension: a view in memory order where its layout is dense.

    The elements' order does not matter to the measurement, so a channels-last or
    transposed gradient is not copied; one whose elements do not fill a block is.
    """
    if not grad.is_contiguous():
        order = sorted(range(grad.dim()), key=grad.stride, reverse=True)
        dense = grad.permute(order)
        if dense.is_contiguous():
            return dense.view(-1)
    return grad.reshape(-1)


def _measured_on_the_host(grads, packed, alone, edges):
    """The `(n, 4)` float32 table of `grads` on the CPU, counted by NumPy in place."""
    table = np.empty((len(grads), 4), np.float32)
    if packed:
        magnitudes, buffers = _magnitudes(grads, packed)
        counts, peaks = _host_counts(magnitudes, buffers.starts, edges)
        table[packed] = _rows(counts, peaks, buffers.host_sizes)
    for i in alone:
        counts = None
        for magnitudes in _magnitude_chunks(grads[i]):
            chunk, peak = _host_counts(magnitudes, _ONE_START, edges)
            if counts is None:
                counts, peaks = chunk, peak
            else:  # NaN's patterns lie above every other: the largest is kept
                counts, peaks = counts + chunk, np.maximum(peaks, peak)
        size = np.full((1, 1), grads[i].numel(), np.float32)
        table[i] = _rows(counts, peaks, size)
    return torch.from_numpy(table)


def _measured_on_the_device(grads, packed, alone, edges):
    """The `(n, 4)` float32 table of `grads`, with no host read (a GPU's)."""
    table = None
    if packed:
        magnitudes, buffers = _magnitudes(grads, packed)
        counts = _histogram(magnitudes, buffers.offsets, len(packed), edges)
        peaks = torch.stack(torch._foreach_max(buffers.views))
        table = torch.cat([counts.float() / buffers.sizes, peaks[:, None]], dim=1)
        if not alone:
            return table
    # In the gradients' order: a run of packed ones (indices ascend) is a slice of `table`.
    ordered, row, i, alone = [], 0, 0, set(alone)
    while i < len(grads):
        if i in alone:
            counts, peak = None, None
            for magnitudes in _magnitude_chunks(grads[i]):
                chunk = _histogram(magnitudes, None, 1, edges)
                # Summed in 64 bits past one chunk; NaN, where one is, kept.
                counts = chunk if counts is None else counts + chunk.long()
                peak = magnitudes.max() if peak is None else torch.maximum(peak, magnitudes.max())
            shares = counts.float() / float(grads[i].numel())
            ordered.append(torch.cat([shares, peak[None, None]], dim=1))
            i += 1
            continue
        end = i + 1
        while end < len(grads) and end not in alone:
            end += 1
        ordered.append(table[row : row + end - i])
        row, i = row + end - i, end
    return torch.cat(ordered) if len(ordered) > 1 else ordered[0]


# The start of the one tensor in a buffer of its own.
_ONE_START = np.zeros(1, np.int64)


def _host_counts(magnitudes, starts, edges):
    """`((n, 3) int64 counts, (n,) int32 peaks)` of the n tensors whose elements start at `starts`.

    The counts are of zero, subnormal and near-maximum elements; a peak is
    the bit pattern of a tensor's largest magnitude. `magnitudes` is a CPU
    tensor, read in place by NumPy as bit patterns (non-negative floats
    order as their patterns, NaN's above inf's). The smallest pattern and
    each tensor's largest (its peak) say which classes are present at
    all; only those are compared over the buffer, and their members
    counted per tensor (`_per_tensor`). Most gradients hold few or no
    zeros, subnormals or values near the maximum.
    """
    patterns = magnitudes.view(torch.int32)
    bits = patterns.numpy()
    if len(starts) > 1:
        peaks = np.maximum.reduceat(bits, starts)
        lowest, highest = bits.min(), peaks.max()
    else:  # torch's one pass for both, on every thread: half NumPy's two
        # (read as NumPy reads the rest: in place, no `item()` dispatched)
        lowest, highest = (int(x.numpy()) for x in torch.aminmax(patterns))
        peaks = np.array([highest], np.int32)
    counts = np.zeros((len(starts), 3), np.int64)  # zero, subnormal, near
    if lowest < edges.subnormal:
        counts[:, 0] = _per_tensor(bits == 0, starts)
        counts[:, 1] = _per_tensor(bits < edges.subnormal, starts) - counts[:, 0]
    if highest > edges.inf:  # a NaN: from `near` to inf in one comparison
        # (a pattern under `near` wraps around to a large unsigned number)
        counts[:, 2] = _per_tensor(
            (bits - edges.near).view(np.uint32) <= edges.inf - edges.near, starts
        )
    elif highest >= edges.near:
        counts[:, 2] = _per_tensor(bits >= edges.near, starts)
    return counts, peaks


def _rows(counts, peaks, sizes):
    """The `(n, 4)` float32 rows of `_host_counts`' results; `sizes` shaped `(n, 1)`, float32."""
    rows = np.empty((len(peaks), 4), np.float32)
    # Exact counts, then one division in float32, as `measure` divides.
    np.divide(counts.astype(np.float32), sizes, out=rows[:, :3])
    rows[:, 3] = peaks.view(np.float32)
    return rows


def _per_tensor(mask, starts):
    """How many elements of the boolean `mask` are set in each tensor (from each of `starts`)."""
    hits = np.count_nonzero(mask)
    if hits == 0:
        return np.zeros(len(starts), np.int64)
    if hits * _SPARSE_BELOW < mask.size:  # a few: each one's tensor found by bisection
        owners = np.searchsorted(starts, np.flatnonzero(mask), side="right") - 1
        return np.bincount(owners, minlength=len(starts))
    # Many: the booleans summed per tensor, in 32 bits where they fit (half the time of 64).
    dtype = np.int32 if mask.size < 2**31 else np.int64
    return np.add.reduceat(mask.view(np.uint8), starts, dtype=dtype).astype(np.int64)


def _histogram(magnitudes, offsets, count, edges):
    """`(count, 3)` int32 counts of zero, subnormal and near elements per tensor.

    `offsets`: each element's tensor index times the classes (None: one tensor).
    """
    bits = magnitudes.view(torch.int32)
    classes = bits.clamp(0, 1)  # the step at 0
    if offsets is not None:
        classes += offsets
    # An element's class is how many steps lie below its pattern.
    for k in (edges.subnormal - 1, edges.near - 1, edges.inf):
        classes += (bits - k).clamp_(0, 1)
    histogram = torch.zeros(count * _CLASSES, dtype=torch.int32, device=bits.device)
    one = torch.ones((), dtype=torch.int32, device=bits.device)
    histogram.index_add_(0, classes, one.expand(classes.shape))
    return histogram.view(count, _CLASSES)[:, (0, 1, 3)]


class _Buffers:
    """A float32 buffer for small tensors' elements, and what counting them needs."""

    def __init__(self, tensors):
        device = tensors[0].device
        sizes = [t.numel() for t in tensors]
        self.flat = torch.empty(sum(sizes), dtype=torch.float32, device=device)
        self.views = [v.view(t.shape) for v, t in zip(self.flat.split(sizes), tensors)]
        # Each element's tensor index times the classes: its histogram row.
        rows = torch.arange(0, len(sizes) * _CLASSES, _CLASSES, dtype=torch.int32)
        self.offsets = torch.repeat_interleave(rows, torch.tensor(sizes)).to(device)
        self.sizes = torch.tensor(sizes, dtype=torch.float32).to(device)[:, None]
        # Where each tensor's elements start, and the sizes (NumPy's counts on the CPU).
        self.starts = np.cumsum([0, *sizes[:-1]])
        self.host_sizes = np.array(sizes, np.float32)[:, None]


def _scratch(device, size):
    """The float32 buffer kept for gradients measured alone, of at least `size` elements."""
    kept = getattr(_BUFFERS, "scratch", None)
    if kept is None:
        kept = _BUFFERS.scratch = {}
    # A buffer made under inference mode cannot be written outside it.
    key = (device, torch.is_inference_mode_enabled())
    buffer = kept.get(key)
    if buffer is None or buffer.numel() < size:
        buffer = kept[key] = torch.empty(size, dtype=torch.float32, device=device)
    return buffer


def _buffers(tensors):
    """The `_Buffers` kept for these tensors' shapes and device."""
    kept = getattr(_BUFFERS, "by_key", None)
    if kept is None:
        kept = _BUFFERS.by_key = {}
    # A buffer made under inference mode cannot be written outside it.
    key = (tensors[0].device, torch.is_inference_mode_enabled(), tuple(t.shape for t in tensors))
    entry = kept.pop(key, None)
    if entry is None:
        entry = _Buffers(tensors)
        while len(kept) >= _BUFFERS_KEPT:
            kept.pop(next(iter(kept)))
    kept[key] = entry  # most recently used last
    return entry
