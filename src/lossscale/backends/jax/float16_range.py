"""The float16 range of many gradients at once, in a few XLA operations.

`mixed_precision.diagnostics.measure` takes about eight XLA operations per
gradient, and XLA on CPU pays for each operation of a `lax.cond` branch on
every step, taken or not. This gives the same four numbers, bit for bit:

- the gradients (as float32) are zero-padded to whole rows of `ROW` and
  concatenated into one matrix while they hold at most `PACK_CAPACITY`
  elements; each gradient past that is reduced alone, in place;
- one variadic `lax.reduce` over the rows counts each row's zero,
  below-normal, near-maximum and NaN elements and finds its peak;
- two scatters sum the counts and peaks per gradient, and the padding is
  taken off the zero and below-normal counts;
- a gradient holding a NaN gets NaN as its largest magnitude, as `max_abs`.

XLA reserves a branch's working memory on every step, so the capacity bounds
it to about `4 * PACK_CAPACITY` bytes whatever the model's size.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

# A divisor of most tensor sizes, long enough that the per-row scatters stay small.
ROW = 64
PACK_CAPACITY = 1 << 22


def measure(grads, subnormal_below, near_from):
    """The backend's `fused_float16_range` kernel (see the protocol); None for no gradients."""
    if not grads:
        return None
    edges = (jnp.float32(subnormal_below), jnp.float32(near_from))
    packed, alone = _split(grads)
    counts, peaks, order = [], [], packed + alone
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
    # Behind a barrier: XLA would divide by a constant through its reciprocal.
    sizes = lax.optimization_barrier(jnp.asarray([g.size for g in grads], jnp.float32))
    # Vector by vector: XLA on CPU divides a broadcast by an approximate reciprocal.
    shares = [c.astype(jnp.float32) / sizes for c in (zero, below - zero, counts[:, 2])]
    return (*shares, jnp.where(counts[:, 3] > 0, jnp.float32(jnp.nan), peak))


def _split(grads):
    """`(packed, alone)`: positions of the gradients packed within `PACK_CAPACITY`, and the rest."""
    packed, alone, size = [], [], 0
    for i, g in enumerate(grads):
        if size + g.size <= PACK_CAPACITY:
            packed.append(i)
            size += g.size
        else:
            alone.append(i)
    return packed, alone


def _packed(grads, edges):
    """`((n, 4) int32 counts, (n,) float32 peaks, the zeros padding each)` of `grads`, in rows."""
    flat = [g.astype(jnp.float32).ravel() for g in grads]
    # Zero pieces only where needed (not `jnp.pad`): the concatenation stays one operation.
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
    """`(zero, below, near, nan, peak)` of `|values|` over `axes`, in one reduction."""
    subnormal_below, near_from = edges
    a = jnp.abs(values)
    flags = [x.astype(jnp.int32) for x in (a == 0, a < subnormal_below, a >= near_from, a != a)]
    initial = (jnp.int32(0),) * 4 + (jnp.float32(0),)
    return lax.reduce((*flags, a), initial, _combined, axes)


def _combined(x, y):
    """The reduction's step: counts add, the peak is the larger one."""
    return (*(p + q for p, q in zip(x[:4], y[:4])), lax.max(x[4], y[4]))
