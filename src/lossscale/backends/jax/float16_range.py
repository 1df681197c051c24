"""The float16 range of many gradients at once, in a few XLA operations.

`mixed_precision.diagnostics.measure` reduces one gradient at a time in
about eight XLA operations. The measurement runs under a `lax.cond` (every
`diagnostics_every` steps), and XLA on CPU pays for each operation of a
branch on every step, taken or not. `measure` here gives the same four
numbers per gradient, bit for bit, in a few operations:

- the gradients (cast to float32) are zero-padded to whole rows of `ROW`
  elements and concatenated into one matrix, in one operation (plus one
  per gradient whose size is not a multiple of `ROW`: its padding), while
  they hold at most `PACK_CAPACITY` elements; each gradient past that is
  reduced alone, in place, in one variadic reduction of its own;
- one variadic `lax.reduce` over the rows counts each row's zero,
  below-normal, near-maximum and NaN elements and finds its largest
  magnitude, in one pass;
- two scatters sum the rows' counts and take their peaks per gradient;
  the padding is taken off the zero and below-normal counts;
- the comparisons are `measure`'s own (`a == 0`, `a < 2^-14`,
  `a >= near`): XLA on CPU reads float32 subnormals as zero in both;
- a gradient holding a NaN gets NaN as its largest magnitude, as
  `max_abs` gives.

A standalone jitted loop over `gpt`'s 29 gradients (CPU ms per step,
median of 14 alternating rounds of 300 steps, a due step every 100): no
branch 0.532, a trivial branch 0.531, this 0.549, the former packed
per-element histogram 0.646; one variadic reduction per gradient (29
operations) cost 0.797 against 0.578 in another run. A due step alone:
about 1.0 ms here, 5.7 ms for the histogram (`tiny`: 0.15 and 1.0).

The packed matrix is a copy, and XLA reserves a branch's working memory
on every step, taken or not: packing every gradient made a jitted step of
`large`'s 16M parameters reserve 69 MiB more with diagnostics on (a
float32 copy of all its gradients, plus the rows' counts), and measuring
GPT-2 small's 124M reserved 512 MiB (949 MiB for bfloat16 gradients).
With the capacity the measurement reserves about `4 * PACK_CAPACITY`
bytes (16 MiB; twice that for half-precision gradients, cast before they
are packed) whatever the model's size: 2.3 MiB on `large`, 15.9 MiB (29.4)
on GPT-2 small.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

# Elements per row of the packed gradients, each row reduced on its own: a
# divisor of most tensor sizes (no padding operation for them), and long
# enough that the per-row scatters stay small next to the gradients.
ROW = 64
# At most this many elements are packed (a float32 copy of them is the
# measurement's working memory, which XLA reserves on every step, the
# branch taken or not); the gradients past it are each reduced alone, in
# place, one operation each. `gpt`'s 1.0M fit.
PACK_CAPACITY = 1 << 22


def measure(grads, subnormal_below, near_from):
    """The float16 range of each of `grads`, as four vectors.

    Args:
        grads: Floating-point arrays, each with at least one element.
        subnormal_below: Magnitudes under it (and above 0) count as subnormal.
        near_from: Magnitudes from it on (inf included) count as near the
            maximum.

    Returns:
        `(zero, subnormal, near_max, max_abs)`, float32 vectors whose entry
        i is `grads[i]`'s; None for no gradients.
    """
    if not grads:
        return None
    # Compared as float32, as in `measure`.
    edges = (jnp.float32(subnormal_below), jnp.float32(near_from))
    packed, alone = _split(grads)
    counts, peaks, order = [], [], packed + alone
    # Zeros each packed gradient was padded with, counted as zero and below
    # normal: taken off below.
    padding = np.zeros(len(grads), np.int32)
    if packed:
        pack_counts, pack_peak, pack_padding = _packed([grads[i] for i in packed], edges)
        counts.append(pack_counts)
        peaks.append(pack_peak)
        padding[packed] = pack_padding
    for i in alone:  # in place: one reduction over the whole gradient
        a = grads[i].astype(jnp.float32)
        *alone_counts, alone_peak = _reduced(a, edges, tuple(range(a.ndim)))
        counts.append(jnp.stack(alone_counts)[None])
        peaks.append(alone_peak[None])
    counts = counts[0] if len(counts) == 1 else jnp.concatenate(counts)
    peak = peaks[0] if len(peaks) == 1 else jnp.concatenate(peaks)
    if order != sorted(order):  # back into the gradients' order (a constant gather)
        position = np.argsort(order)
        counts, peak = counts[position], peak[position]
    pads = jnp.asarray(padding)
    zero, below = counts[:, 0] - pads, counts[:, 1] - pads
    # Behind a barrier: XLA would divide by a constant through its
    # reciprocal, one rounding off the exact quotient `measure` gives.
    sizes = lax.optimization_barrier(jnp.asarray([g.size for g in grads], jnp.float32))
    # Vector by vector: XLA on CPU divides a broadcast (n, 3) / (n, 1) by an
    # approximate reciprocal, a vector by a vector exactly (as `measure`).
    shares = [c.astype(jnp.float32) / sizes for c in (zero, below - zero, counts[:, 2])]
    # As `max_abs`: NaN where a gradient holds one.
    return (*shares, jnp.where(counts[:, 3] > 0, jnp.float32(jnp.nan), peak))


def _split(grads):
    """`(packed, alone)`: the positions of the gradients packed together, and of the others.

    In order, a gradient is packed while the packed ones stay within
    `PACK_CAPACITY` elements (a concatenation copies them), else measured
    alone: the measurement's memory does not grow with the model.
    """
    packed, alone, size = [], [], 0
    for i, g in enumerate(grads):
        if size + g.size <= PACK_CAPACITY:
            packed.append(i)
            size += g.size
        else:
            alone.append(i)
    return packed, alone


def _packed(grads, edges):
    """`((n, 4) int32 counts, (n,) float32 peaks, the zeros padding each)` of `grads`, in rows.

    The padding is counted as zero and below normal.
    """
    flat = [g.astype(jnp.float32).ravel() for g in grads]
    # Each gradient padded with zeros to whole rows. Zeros only where
    # a size is not a multiple of ROW (XLA fills each with one operation; a
    # `jnp.pad` would be one per gradient), and the absolute value is taken
    # inside the reduction, so the concatenation is one operation.
    padding = [-x.size % ROW for x in flat]
    pieces = [y for x, p in zip(flat, padding) for y in (x, np.zeros(p, np.float32)) if y.size]
    rows = jnp.concatenate(pieces).reshape(-1, ROW)
    zero, below, near, nan, peak = _reduced(rows, edges, (1,))
    # Each row's gradient (a constant of the trace); rows are in order.
    owner = np.repeat(np.arange(len(grads)), [(x.size + p) // ROW for x, p in zip(flat, padding)])
    counts = jnp.stack([zero, below, near, nan], axis=1)
    counts = (
        jnp.zeros((len(grads), 4), jnp.int32)
        .at[owner]
        .add(counts, indices_are_sorted=True, mode="promise_in_bounds")
    )
    peak = (
        jnp.zeros(len(grads), jnp.float32)
        .at[owner]
        .max(peak, indices_are_sorted=True, mode="promise_in_bounds")
    )
    return counts, peak, padding


def _reduced(values, edges, axes):
    """`(zero, below, near, nan, peak)` of `values`' magnitudes over `axes`, in one reduction.

    Int32 counts and the float32 peak, each over what `axes` leave. `below`
    counts magnitudes under `edges[0]`, zero included; `peak` is the
    largest magnitude, NaN or not (the caller decides from `nan`).
    """
    subnormal_below, near_from = edges
    a = jnp.abs(values)
    flags = [x.astype(jnp.int32) for x in (a == 0, a < subnormal_below, a >= near_from, a != a)]
    initial = (jnp.int32(0),) * 4 + (jnp.float32(0),)
    return lax.reduce((*flags, a), initial, _combined, axes)


def _combined(x, y):
    """The reduction's step: counts add, the peak is the larger one."""
    return (*(p + q for p, q in zip(x[:4], y[:4])), lax.max(x[4], y[4]))
