"""JAX's multi-array helpers: unscale, the finite check and norms (part of the backend).

Every function takes a list of arrays and returns arrays (under `jax.jit`,
traced values); none reads a value on the host. The finite check reduces
small arrays together, in chunks, exactly (sums of `x - x`, which propagate
NaN where XLA's CPU max drops it), and on the CPU settles large ones with a
plain sum first (`finite_unscaled`).
"""

import jax
import jax.numpy as jnp
from jax import lax

from lossscale.backends._common import unscale_then_check, unwrap


def unscale(grads, scale, in_place=False, reciprocal=False):
    """`grads` divided by `scale` (half-precision gradients in float32).

    Arrays are immutable: `in_place` has nothing to permit. `reciprocal`
    (the caller guarantees every scale is a power of two) multiplies by the
    reciprocal instead, which rounds exactly as division does and which XLA
    fuses into each reader of a gradient, where it writes a quotient out to
    a scratch buffer first. The reciprocal is kept a normal number, so that
    a flush-to-zero CPU mode does not zero it: above 2^126 the gradient is
    halved first (exact) and multiplied by `2 / scale`.
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
    """The scalar `s` as `g` is divided by it: eagerly, for the correctly rounded quotient.

    Run eagerly, `g / s` is a computation of its own, which XLA's CPU
    simplifier turns into `g * (1 / s)`: not the quotient where `s` is not
    a power of two (1 ulp off for about 40 % of the elements at `s = 3`).
    Divided by `s` already broadcast to `g`'s shape, it is the quotient
    (NumPy's, TensorFlow's), which the jitted steps tested (ours and
    Keras's `stateless_apply`, where the division is part of the step)
    give too. Traced, `s` is left a scalar: the step is XLA's to compile.
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
    """Whether every element of `arrays`, divided by `scale`, is finite.

    Exact for every size, position, dtype and sharding. XLA's vectorised
    CPU max reduction drops NaN (`max([1, nan, 2])` is 2 past a few
    thousand elements), so non-finite elements are found by a sum of
    `x - x`: zero where `x` is finite, NaN where not, and addition
    propagates NaN in any order. Given every element finite, the largest
    magnitude is exact, and over the scale (division is monotone) it says
    whether a quotient overflows. On the CPU large arrays take a cheaper
    plain sum first (`_finite_large`). `scale=None`: not divided.

    `reciprocal`: the caller guarantees the scale is a power of two of at
    least 2^-126 (`LossScalePolicy.scales_are_powers_of_two`). Then
    `y = x * (1 / scale)` is the float32 quotient itself, and one sum of
    `y - y` finds both a non-finite element and an overflow once unscaled:
    no peak, and on the CPU no `lax.cond` for it. Above 2^126 the
    reciprocal is subnormal and may be flushed to zero, which still gives
    NaN for inf and NaN alone, and no quotient by such a scale overflows.
    It trades the `cond` for a multiply per element: on the CPU the check
    of `tiny` (28 arrays) took 0.084 ms against 0.113, that of `many_small`
    (1M elements) 0.797 against 0.672, so no step passes it yet (see
    docs/performance.md, JAX).
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


# Arrays of at least this many elements are checked by their sums first, and
# the peak of any array is taken under a scalar `lax.cond`, where the default
# backend is one of these. Not on GPUs: there XLA reads a `conditional`'s
# predicate back to the host, a wait inside every step, and fuses the
# reductions that read one array into one pass.
_SUMMED = 1 << 18
_SUMS_FIRST_ON = frozenset({"cpu"})


def _finite_large(arrays, scale, reciprocal):
    """`finite_unscaled` for large arrays, from their plain sums where it can.

    A sum is finite only when every element is (inf and NaN propagate
    through additions in any order), and dividing by a scale of at least 1
    cannot overflow: finite sums and such a scale settle the flag. A plain
    sum is the cheapest reduction XLA's CPU backend has (about half the
    time of the largest magnitude, 0.63 against 1.35 ms over eight float32
    arrays of 1M). Only where a sum is not finite (an overflow of the sum
    itself included) or the scale is below 1 does `lax.cond` take the
    exact branch; it returns a scalar, so it copies no array. (Under
    `jax.vmap` with a flag per member the `cond` becomes a select, and both
    branches run.)
    """
    sums = [jnp.sum(a, dtype=jnp.float32) for a in arrays]
    quick = jnp.all(jnp.stack([jnp.isfinite(s) for s in sums]))
    if scale is not None:
        quick = jnp.logical_and(quick, scale >= 1)
    # The taken-quick branch returns `quick` itself (True there), not a
    # constant: inside `shard_map` both branches then vary over the same
    # mesh axes as the gradients, as its `check_vma` requires.
    return lax.cond(quick, lambda: quick, lambda: _exact_finite(arrays, scale, reciprocal))


def _exact_finite(arrays, scale, reciprocal):
    """`finite_unscaled`, exactly: sums of `x - x`, then (with a scale) the largest magnitude.

    By the `reciprocal` (see `finite_unscaled`): sums of `y - y` alone.
    """
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
    # A scale of at least 1 cannot make a finite quotient overflow: on the
    # CPU the peak (a second read of every gradient) is taken only below 1.
    # `finite | True`, not a constant: the branches vary alike (see `_finite_large`).
    return jnp.logical_and(
        finite, lax.cond(scale >= 1, lambda: jnp.logical_or(finite, True), quotient_finite)
    )


def _groups_finite(groups, factor=None):
    """Whether every element of `groups` (times `factor`) is finite, by float32 sums of `x - x`."""
    # In float32, the dtype the peaks are compared in: a float64 element
    # beyond float32's range counts as an overflow.
    zeros = []
    for g in groups:
        if factor is None:
            g = g.astype(jnp.float32)
        else:
            # XLA would broadcast the factor once per shape and share it
            # among the same-shaped gradients, and its CPU reduction
            # fusions then read that broadcast from a gradient-sized
            # buffer. Passing each gradient and the factor through one
            # barrier makes each broadcast its own, fused into its reader.
            g, f = lax.optimization_barrier((g, factor))
            g = g.astype(jnp.float32) * f
        zeros.append(jnp.sum(_zero_or_nan(g)))
    return jnp.isfinite(zeros[0] if len(zeros) == 1 else jnp.sum(jnp.stack(zeros)))


def _zero_or_nan(x):
    # `x - x`, not `x * 0`: XLA's CPU backend writes the broadcast zero out
    # as an array the size of `x` for the reduction to read.
    return x - x


def _groups_peak(groups):
    """The float32 largest magnitude of `groups`: exact where every element is finite."""
    peaks = [jnp.max(jnp.abs(g)).astype(jnp.float32) for g in groups]
    return peaks[0] if len(peaks) == 1 else jnp.max(jnp.stack(peaks))


# Arrays up to this size are reduced together, concatenated per dtype into
# chunks of at most `PACK_CAPACITY` elements: on CPU each reduction is several XLA
# thunks, so a 400-tensor model's check took 645 us one tensor at a time and
# 263 us concatenated. Larger arrays are reduced in place (a concatenation
# would copy them).
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
    """Largest |x| over all arrays, float32: inf if any element is, else NaN if any is NaN.

    The largest magnitude alone can be finite where an element is NaN (see
    `finite_unscaled`), so the exact finite check decides: where it fails
    and the peak is not inf, the result is NaN.
    """
    groups = _groups(arrays)
    if not groups:
        return jnp.asarray(0.0, jnp.float32)
    peak = _groups_peak(groups)
    # `peak == inf`, not `isinf`: with every element NaN the max reduction
    # drops them all and returns its start, -inf.
    return jnp.where(_groups_finite(groups) | (peak == jnp.inf), peak, jnp.float32(jnp.nan))
