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
- on a device whose memory the host reads without waiting (the CPU:
  `multi.HOST_READABLE`), NumPy counts the classes instead, in the
  buffers' own memory (`_counted_on_the_host`): the same counts, three to
  four times faster than torch's CPU kernels;
- the counts are divided by the sizes and the largest magnitudes come
  from `torch._foreach_max`, one `torch.stack` making them a vector.

Gradients of `multi.PACK_BELOW` elements or more (or past
`multi.PACK_CAPACITY` packed: the finite check's packing rule) are measured
alone, in buffers of their own, so no buffer kept between steps grows past
`multi.PACK_CAPACITY` elements.
"""

import struct
import threading

import numpy as np
import torch

from lossscale.backends.torch import dtensors, multi

# Buffers by (device, inference mode, shapes), one set per thread; the last
# few kept.
_BUFFERS = threading.local()
_BUFFERS_KEPT = 4
# Classes per gradient in the histogram: zero, subnormal, normal, near, NaN.
_CLASSES = 5


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
        or any(dtensors.is_dtensor(g) for g in grads)
        or len({g.device for g in grads}) > 1
    ):
        return None
    # bits >= 1: not zero; >= subnormal_below: normal; >= near_from: near;
    # above inf's: NaN. The thresholds compare as float32, as in `measure`.
    steps = (0, _bits(subnormal_below) - 1, _bits(near_from) - 1, _INF_BITS)
    packed, alone = _chunks(grads)
    with torch.no_grad():
        table, peaks = [], [None] * len(grads)
        if packed:
            rows, maxima = _packed([grads[i] for i in packed], steps)
            for i, peak in zip(packed, maxima):
                peaks[i] = peak
        # The rows in the gradients' order: a run of packed gradients (their
        # indices are ascending) stays one slice of `rows`.
        position = {i: k for k, i in enumerate(packed)}
        i = 0
        while i < len(grads):
            if i in position:
                end = i + 1
                while end in position:
                    end += 1
                table.append(rows[position[i] : position[end - 1] + 1])
                i = end
            else:
                shares, peaks[i] = _alone(grads[i], steps)
                table.append(shares)
                i += 1
        shares = torch.cat(table) if len(table) > 1 else table[0]
        return shares[:, 0], shares[:, 1], shares[:, 2], torch.stack(peaks)


def _chunks(grads):
    """(indices packed into one buffer, indices measured alone), in order."""
    packed, alone = multi.split_small(grads)
    if len(packed) == 1:
        return [], packed + alone
    return packed, alone


def _packed(tensors, steps):
    """`((n, 3) float32 shares, n largest magnitudes)` of n small tensors, at once."""
    buffers = _buffers(tensors)
    torch._foreach_copy_(buffers.views, tensors)  # float32, as `measure` rounds
    # The views now hold the magnitudes.
    counts = _counts(buffers.flat.abs_(), buffers.starts, buffers.offsets, steps)
    return counts.float() / buffers.sizes, torch._foreach_max(buffers.views)


def _alone(tensor, steps):
    """`((1, 3) float32 shares, largest magnitude)` of one tensor."""
    flat = tensor.reshape(-1).to(torch.float32, copy=True).abs_()
    counts = _counts(flat, None, None, steps)
    return counts.float() / float(flat.numel()), flat.max()


def _counts(magnitudes, starts, offsets, steps):
    """`(n, 3)` counts of zero, subnormal and near elements of the n tensors in `magnitudes`.

    Counted by NumPy where the host reads the device's memory without
    waiting, else by the device histogram. `starts` (NumPy element indices)
    and `offsets` (`_histogram`'s) place the tensors; both None: one tensor.
    """
    if magnitudes.device.type in multi.HOST_READABLE:
        return _counted_on_the_host(magnitudes, starts, steps)
    count = 1 if offsets is None else len(starts)
    return _histogram(magnitudes, offsets, count, steps)


def _counted_on_the_host(magnitudes, starts, steps):
    """`(n, 3)` int64 counts of zero, subnormal and near elements, as `_histogram`'s.

    Of the n tensors whose elements start at the NumPy indices `starts` in
    the CPU tensor `magnitudes` (None: one tensor), read off how many bit
    patterns lie above each step (an element's class is the number of
    steps below it). NumPy compares and counts the tensor's own memory
    three to four times faster than torch's CPU kernels build and count
    the classes.
    """
    bits = magnitudes.view(torch.int32).numpy()
    if starts is None:
        above = np.array([[np.count_nonzero(bits > k)] for k in steps], np.int64)
        sizes = np.array([bits.size], np.int64)
    else:
        # Booleans summed per tensor, in 32 bits (a pack holds far fewer
        # than 2**31 elements): half the time of 64-bit sums.
        above = np.stack(
            [np.add.reduceat((bits > k).view(np.uint8), starts, dtype=np.int32) for k in steps]
        ).astype(np.int64)
        sizes = np.diff(starts, append=bits.size)
    counts = np.stack([sizes - above[0], above[0] - above[1], above[2] - above[3]], axis=1)
    return torch.from_numpy(counts)


def _histogram(magnitudes, offsets, count, steps):
    """`(count, 3)` int32 counts of zero, subnormal and near elements per tensor.

    `offsets`: each element's tensor index times the classes (None: one tensor).
    """
    bits = magnitudes.view(torch.int32)
    classes = bits.clamp(0, 1)  # the step at 0
    if offsets is not None:
        classes += offsets
    for k in steps[1:]:
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
        # Where each tensor's elements start (NumPy's counts on the CPU).
        self.starts = np.cumsum([0, *sizes[:-1]])


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
