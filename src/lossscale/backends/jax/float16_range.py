"""The float16 range of many gradients at once, in a few XLA operations.

`mixed_precision.diagnostics.measure` reduces one gradient at a time: about
eight XLA operations each. Under `lax.cond` (the measurement runs every
`diagnostics_every` steps) XLA on CPU pays for a branch's operations even on
the steps that do not take it, so a 28-gradient model's step cost 0.8 ms
more with diagnostics at every 100 steps than without. `measure` here gives
the same four numbers per gradient, bit for bit, in a number of operations
that does not grow with the number of small gradients:

- gradients of up to `PACK_UP_TO` elements are cast to float32 and
  concatenated, in chunks of at most `PACK_CAPACITY` elements; larger
  ones are measured alone;
- each element gets a class (0: zero, 1: float16 subnormal, 2: normal,
  3: near float16's maximum or inf, 4: NaN) from three comparisons (not
  from its bit pattern as on torch: XLA on CPU flushes float32 subnormals
  to zero in comparisons, and `measure` counts them as zero);
- one scatter-add counts the classes per gradient, one scatter-max finds
  each gradient's largest magnitude apart from NaN, and a gradient
  holding a NaN gets NaN there, as `max_abs` gives.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

# Not `multi`'s packing rule (which weighs a concatenation's copy against
# its reductions, every step): here each operation of a gradient measured
# alone costs on the steps that skip the branch, and packing costs only on
# the measured ones (a scatter of ~10 ns per element on CPU), so gradients
# up to 2^17 elements are packed.
PACK_UP_TO, PACK_CAPACITY = 1 << 17, 1 << 20
# Classes per gradient in the histogram: zero, subnormal, normal, near, NaN.
_CLASSES = 5


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
    rows, peaks = {}, {}
    for indices in _chunks([g.size for g in grads]):
        members = [grads[i] for i in indices]
        counts, maxima = _measured(members, edges)
        for k, i in enumerate(indices):
            rows[i], peaks[i] = counts[k], maxima[k]
    order = range(len(grads))
    counts = jnp.stack([rows[i] for i in order]) if len(rows) > 1 else rows[0][None]
    peak = jnp.stack([peaks[i] for i in order]) if len(peaks) > 1 else peaks[0][None]
    # Behind a barrier: XLA would divide by a constant through its
    # reciprocal, one rounding off the exact quotient `measure` gives.
    sizes = lax.optimization_barrier(jnp.asarray([g.size for g in grads], jnp.float32))
    # Column by column: XLA on CPU divides a broadcast (n, 3) / (n, 1) by
    # an approximate reciprocal, a vector by a vector exactly (as `measure`).
    shares = [counts[:, k].astype(jnp.float32) / sizes for k in range(3)]
    # As `max_abs`: NaN where a gradient holds one.
    peak = jnp.where(counts[:, 3] > 0, jnp.float32(jnp.nan), peak)
    return (*shares, peak)


def _chunks(sizes):
    """Index groups, in order: runs of small gradients packed together, larger ones alone."""
    groups, chunk, total = [], [], 0
    for i, n in enumerate(sizes):
        if n > PACK_UP_TO:
            groups.append([i])
            continue
        if total + n > PACK_CAPACITY:
            groups.append(chunk)
            chunk, total = [], 0
        chunk.append(i)
        total += n
    return groups + ([chunk] if chunk else [])


def _measured(members, edges):
    """`(counts, peaks)` of `members`: (n, 4) int32 zero/subnormal/near/NaN counts, n peaks.

    The peaks are the largest magnitudes with NaN read as 0.
    """
    flat = [jnp.abs(g.astype(jnp.float32)).ravel() for g in members]
    a = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
    classes = _classes(a, edges)
    finite_or_inf = jnp.where(classes == 4, jnp.float32(0), a)
    if len(flat) == 1:
        counts = jnp.stack([jnp.sum(classes == c) for c in (0, 1, 3, 4)]).astype(jnp.int32)
        return counts[None], jnp.max(finite_or_inf)[None]
    sizes = [x.size for x in flat]
    # Each element's gradient, as a histogram row (a constant of the trace).
    owner = jnp.asarray(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes))
    histogram = jnp.zeros(len(sizes) * _CLASSES, jnp.int32)
    histogram = histogram.at[owner * _CLASSES + classes].add(1, mode="promise_in_bounds")
    counts = histogram.reshape(len(sizes), _CLASSES)[:, np.array([0, 1, 3, 4])]
    peaks = jnp.zeros(len(sizes), jnp.float32)
    peaks = peaks.at[owner].max(finite_or_inf, indices_are_sorted=True, mode="promise_in_bounds")
    return counts, peaks


def _classes(a, edges):
    """Each magnitude's class: 0 zero, 1 subnormal, 2 normal, 3 near the maximum, 4 NaN.

    By float comparisons, as `measure` counts: XLA on CPU reads float32
    subnormals as zero (flush to zero) in both.
    """
    subnormal_below, near_from = edges
    counted = (a > 0).astype(jnp.int32) + (a >= subnormal_below) + (a >= near_from)
    return jnp.where(jnp.isnan(a), 4, counted)
