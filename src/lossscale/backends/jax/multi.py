"""JAX's multi-array helpers: unscale, the finite check and norms; none reads the host."""

import jax
import jax.numpy as jnp
from jax import lax

from lossscale.backends._common import unscale_then_check, unwrap


def unscale(grads, scale, in_place=False, reciprocal=False):
    """`grads` divided by `scale` (half-precision gradients in float32); `in_place` is moot.

    `reciprocal` (every scale a power of two) multiplies by the reciprocal,
    which is exact and which XLA fuses into each reader. It is kept normal
    against flush-to-zero: above 2^126 the gradient is halved first.
    """
    scale = unwrap(scale)
    factors, out = {}, []
    for g in grads:
        g = unwrap(g)
        if g.dtype.itemsize < 4:
            g = g.astype(jnp.float32)
        s = scale.astype(g.dtype)
        if not reciprocal:
            out.append(g / _divisor(s, g))
            continue
        if g.dtype not in factors:
            big = s > 2.0**126
            factors[g.dtype] = (
                jnp.where(big, 0.5, 1.0).astype(g.dtype),
                jnp.where(big, 2 / s, 1 / s),
            )
        half, inverse = factors[g.dtype]
        out.append(g * half * inverse)
    return out


def _divisor(s, g):
    """The scalar `s` as `g` is divided by it, broadcast when eager.

    An eager `g / s` by a scalar becomes `g * (1 / s)` in XLA's CPU
    simplifier, which rounds differently; by a broadcast `s` it is the
    correctly rounded quotient.
    """
    if isinstance(s, jax.core.Tracer) or isinstance(g, jax.core.Tracer):
        return s
    return jnp.broadcast_to(s, g.shape)


def unscale_checked(grads, scale, in_place=False):
    """`(unscaled, finite, skip)`: `unscale`, then `finite_flags` of the result."""
    return unscale_then_check(unscale, finite_flags, grads, scale, in_place)


def all_finite(arrays):
    """Whether every element of `arrays` is finite (exact at every size)."""
    return finite_unscaled(arrays, None)


def finite_unscaled(arrays, scale, reciprocal=False):
    """Whether every element of `arrays`, divided by `scale` (None: not divided), is finite.

    Exact for every size, position, dtype and sharding. XLA's CPU max
    reduction drops NaN, so non-finite elements are found by a sum of
    `x - x` (NaN propagates in any order); then the largest magnitude over
    the scale says whether a quotient overflows. On the CPU large arrays
    take a cheaper plain sum first (`_finite_large`).

    `reciprocal`: the scale is a power of two of at least 2^-126. Then one
    sum of `y - y`, `y = x * (1 / scale)`, finds both a non-finite element
    and an overflow: no peak and no `lax.cond`.
    """
    summed = _SUMMED if jax.default_backend() in _SUMS_FIRST_ON else None
    small, large = [], []
    for a in map(unwrap, arrays):
        if a.size:
            (large if summed is not None and a.size >= summed else small).append(a)
    flags = []
    scale = None if scale is None else unwrap(scale)
    if small:
        flags.append(_exact_finite(small, scale, reciprocal))
    if large:
        flags.append(_finite_large(large, scale, reciprocal))
    if not flags:
        return jnp.asarray(True)
    return flags[0] if len(flags) == 1 else jnp.logical_and(*flags)


# On these backends arrays of at least `_SUMMED` elements are checked by their
# sums first, and peaks are taken under a `lax.cond`. Not on GPUs: XLA reads a
# `conditional`'s predicate back to the host there.
_SUMMED = 1 << 18
_SUMS_FIRST_ON = frozenset({"cpu"})


def _finite_large(arrays, scale, reciprocal):
    """`finite_unscaled` for large arrays, from their plain sums where it can.

    Finite sums and a scale of at least 1 settle the flag (a plain sum is
    XLA's cheapest CPU reduction); else `lax.cond` takes the exact branch.
    """
    sums = [jnp.sum(a, dtype=jnp.float32) for a in arrays]
    quick = jnp.all(jnp.stack([jnp.isfinite(s) for s in sums]))
    if scale is not None:
        quick = jnp.logical_and(quick, scale >= 1)
    # `quick` itself, not a constant: `shard_map`'s `check_vma` wants both
    # branches to vary over the same mesh axes.
    return lax.cond(quick, lambda: quick, lambda: _exact_finite(arrays, scale, reciprocal))


def _exact_finite(arrays, scale, reciprocal):
    """`finite_unscaled`, exactly: sums of `x - x`, then (with a scale) the largest magnitude."""
    groups = _groups(arrays)
    if scale is None:
        return _groups_finite(groups)
    if reciprocal:
        return _groups_finite(groups, 1 / jnp.asarray(scale, jnp.float32))
    finite = _groups_finite(groups)

    def quotient_finite():
        # Exact wherever it matters: with an inf or NaN present `finite` is false.
        return jnp.isfinite(_groups_peak(groups) / scale)

    if jax.default_backend() not in _SUMS_FIRST_ON:
        return jnp.logical_and(finite, quotient_finite())
    # On the CPU the peak (a second read) is taken only for a scale below 1;
    # `finite | True`, not a constant: see `_finite_large`.
    return jnp.logical_and(
        finite, lax.cond(scale >= 1, lambda: jnp.logical_or(finite, True), quotient_finite)
    )


def _groups_finite(groups, factor=None):
    """Whether every element of `groups` (times `factor`) is finite, by float32 sums of `x - x`."""
    # In float32: a float64 element beyond float32's range counts as an overflow.
    zeros = []
    for g in groups:
        if factor is None:
            g = g.astype(jnp.float32)
        else:
            # A barrier per gradient keeps XLA from sharing one broadcast of
            # the factor among same-shaped gradients as a gradient-sized buffer.
            g, f = lax.optimization_barrier((g, factor))
            g = g.astype(jnp.float32) * f
        zeros.append(jnp.sum(_zero_or_nan(g)))
    return jnp.isfinite(zeros[0] if len(zeros) == 1 else jnp.sum(jnp.stack(zeros)))


def _zero_or_nan(x):
    return x - x  # not `x * 0`: XLA's CPU backend would write the broadcast zero out


def _groups_peak(groups):
    """The float32 largest magnitude of `groups`: exact where every element is finite."""
    peaks = [jnp.max(jnp.abs(g)).astype(jnp.float32) for g in groups]
    return peaks[0] if len(peaks) == 1 else jnp.max(jnp.stack(peaks))


# Arrays up to this size are concatenated per dtype into chunks of at most
# `PACK_CAPACITY` elements and reduced together: each XLA reduction has a cost.
PACK_UP_TO, PACK_CAPACITY = 4096, 1 << 16


def _groups(arrays):
    """The non-empty `arrays` as flat groups to reduce: small ones concatenated per dtype."""
    groups, chunks = [], {}
    for a in map(unwrap, arrays):
        if not a.size:
            continue
        if a.size > PACK_UP_TO:
            groups.append(a)
            continue
        chunk = chunks.setdefault(a.dtype, [[], 0])
        if chunk[1] + a.size > PACK_CAPACITY:
            groups.append(_joined(chunk[0]))
            chunk[:] = [[], 0]
        chunk[0].append(a.ravel())
        chunk[1] += a.size
    return groups + [_joined(parts) for parts, _ in chunks.values() if parts]


def _joined(parts):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def finite_flags(arrays):
    finite = all_finite(arrays)
    return finite, jnp.logical_not(finite).astype(jnp.float32)


def global_norm(arrays):
    arrays = [unwrap(a) for a in arrays]
    squares = [
        jnp.sum(jnp.square(a.astype(jnp.float32) if a.dtype.itemsize < 4 else a)) for a in arrays
    ]
    return jnp.sqrt(jnp.sum(jnp.stack(squares)))


def max_abs(arrays):
    """Largest |x| over all arrays, float32: inf if any element is, else NaN if any is NaN."""
    groups = _groups(arrays)
    if not groups:
        return jnp.asarray(0.0, jnp.float32)
    peak = _groups_peak(groups)
    # Not `isinf`: with every element NaN the max reduction returns -inf.
    return jnp.where(_groups_finite(groups) | (peak == jnp.inf), peak, jnp.float32(jnp.nan))
