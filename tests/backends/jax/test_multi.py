"""The JAX backend's multi-array helpers: unscale, the finite check, norms."""

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lossscale as ls
from lossscale.backends.jax import multi as jax_multi


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_unscale_in_float32(dtype, rng):
    grads = [rng.normal(size=(4, 3)) * 1024, rng.normal(size=(5,)) * 1024]
    native = [jnp.asarray(g, dtype=dtype) for g in grads]
    out = jax_multi.unscale(native, jnp.asarray(np.float32(1024.0)))
    for o, n in zip(out, native):
        assert o.dtype == jnp.float32
        # Exact: a half-precision value divided by a power of two in float32.
        np.testing.assert_array_equal(np.asarray(o), np.asarray(n, np.float32) / 1024)


def test_unscale_keeps_small_half_gradients_representable():
    # 1e-3 * 2**-16 underflows float16 (smallest subnormal ~6e-8) but not float32.
    g = jnp.asarray(np.float16(1e-3))
    out = jax_multi.unscale([g], jnp.asarray(np.float32(2.0**16)))[0]
    assert float(out) > 0 and np.float16(float(out)) == 0


def test_all_finite(rng):
    good = [
        jnp.asarray(rng.normal(size=3), jnp.float16),
        jnp.asarray(rng.normal(size=(2, 2))),
        jnp.zeros((0, 3)),
        jnp.asarray([3, -7], jnp.int32),
    ]
    assert bool(jax_multi.all_finite(good))
    assert bool(jax_multi.all_finite([]))
    assert bool(jax_multi.all_finite([jnp.zeros(0)]))
    # Finite values at the edge of the range stay finite.
    assert bool(jax_multi.all_finite([jnp.asarray([65504.0, -65504.0], jnp.float16)]))
    for bad in (np.inf, -np.inf, np.nan):
        arrays = good + [jnp.asarray([0.0, bad], jnp.bfloat16)]
        assert not bool(jax_multi.all_finite(arrays))
        assert not bool(jax.jit(jax_multi.all_finite)(arrays))


def test_small_arrays_are_reduced_together_and_large_ones_alone(rng, monkeypatch):
    """Chunks of small arrays per dtype: the same maximum, every element seen."""
    monkeypatch.setattr(jax_multi, "PACK_UP_TO", 8)
    monkeypatch.setattr(jax_multi, "PACK_CAPACITY", 20)
    arrays = [jnp.asarray(rng.normal(size=n).astype(np.float32)) for n in (3, 8, 5, 9, 7, 6, 1)]
    arrays += [jnp.asarray(rng.normal(size=4), jnp.float16), jnp.zeros(0)]
    expected = max(float(np.max(np.abs(np.asarray(a, np.float32)))) for a in arrays if a.size)
    assert float(jax_multi.max_abs(arrays)) == expected
    assert float(jax.jit(jax_multi.max_abs)(arrays)) == expected
    # 2 chunks of float32 (3 + 8 + 5, then 7 + 6 + 1), 1 of float16, the 9 alone.
    assert len(jax_multi._groups(arrays)) == 4
    for i, a in enumerate(arrays):
        for position in (0, a.size - 1) if a.size else ():
            bad = list(arrays)
            bad[i] = a.at[position].set(np.inf)
            assert not bool(jax.jit(jax_multi.all_finite)(bad)), (i, position)
            assert float(jax_multi.max_abs(bad)) == np.inf


def _exact_flag(arrays, scale):
    peak = np.max([np.max(np.abs(np.asarray(a, np.float64))) for a in arrays])  # NaN propagates
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(np.float32(peak) / np.float32(scale))))


@pytest.mark.parametrize(
    "case, values, dtype, scale, finite",
    [
        ("finite", [1.5, -2.0, 3.0], "float32", 1024.0, True),
        ("inf", [1.5, np.inf, 3.0], "float32", 1024.0, False),
        ("nan", [1.5, np.nan, 3.0], "float32", 1024.0, False),
        ("inf and -inf: the sum is NaN", [np.inf, -np.inf, 0.0], "float32", 2.0, False),
        ("the sum overflows, every element is finite", [3e38, 3e38, 1.0], "float32", 1.0, True),
        ("overflows when divided by a scale below 1", [2e38, 1.0, 1.0], "float32", 0.5, False),
        ("a finite sum, but overflows when divided", [2e38, -2e38, 1.0], "float32", 0.5, False),
        ("a scale below 1 that does not overflow", [2.0, -1.0, 1.0], "float32", 0.5, True),
        ("half precision at its largest, summed in float32", [65504.0] * 3, "float16", 1.0, True),
        ("half precision inf", [65504.0, np.inf, 1.0], "float16", 1.0, False),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_large_arrays_checked_by_their_sums_get_the_exact_flag(
    case, values, dtype, scale, finite, jit, rng, monkeypatch
):
    """`finite_unscaled` equals `isfinite(max_abs / scale)`, through the plain or the exact sum."""
    monkeypatch.setattr(jax_multi, "_SUMMED", 8)
    large = np.resize(np.asarray(values, np.float64), 12)
    arrays = [
        jnp.asarray(rng.normal(size=8).astype(np.float32)),  # large, finite
        jnp.asarray(large.astype(dtype)),
        jnp.asarray(rng.normal(size=3).astype(np.float32)),  # small: its exact sum
    ]
    scale = jnp.float32(scale)
    assert _exact_flag(arrays, scale) is finite, case  # the case is what it says
    check = jax.jit(jax_multi.finite_unscaled) if jit else jax_multi.finite_unscaled
    assert bool(check(arrays, scale)) is finite, case
    unscaled_check = jax.jit(jax_multi.all_finite) if jit else jax_multi.all_finite
    assert bool(unscaled_check(arrays)) is bool(np.all(np.isfinite(large.astype(dtype)))), case


def test_a_small_array_is_checked_exactly_beside_large_ones(monkeypatch):
    monkeypatch.setattr(jax_multi, "_SUMMED", 8)
    large = jnp.ones(8)
    for bad in (np.inf, np.nan):
        small = jnp.asarray([1.0, bad])
        assert not bool(jax.jit(jax_multi.finite_unscaled)([large, small], jnp.float32(2.0)))
    # Finite, but not once divided by the scale.
    small = jnp.asarray([1.0, 3e38], jnp.float32)
    assert not bool(jax_multi.finite_unscaled([large, small], jnp.float32(0.5)))
    assert bool(jax_multi.finite_unscaled([large, small], jnp.float32(2.0)))


def _primitives(jaxpr):
    """The names of the primitives of `jaxpr`, outside any sub-jaxpr, and those inside."""
    outer = [e.primitive.name for e in jaxpr.eqns]
    inner = [
        e2.primitive.name
        for e in jaxpr.eqns
        for param in e.params.values()
        for sub in (param if isinstance(param, (tuple, list)) else [param])
        if hasattr(sub, "jaxpr")
        for e2 in sub.jaxpr.eqns
    ]
    return outer, inner


def test_large_arrays_are_reduced_by_a_sum_and_exactly_only_in_the_exact_branch(monkeypatch):
    """A large array is read by one plain sum per step; the exact check runs only where it is not finite."""
    monkeypatch.setattr(jax_multi, "_SUMMED", 8)
    monkeypatch.setattr(jax_multi, "PACK_UP_TO", 8)  # each large array on its own
    arrays = [jnp.ones(16), jnp.ones(9), jnp.ones(3)]
    jaxpr = jax.make_jaxpr(jax_multi.finite_unscaled)(arrays, jnp.float32(2.0)).jaxpr
    outer, inner = _primitives(jaxpr)
    # The large arrays' plain sums and the small array's `x - x`; two
    # `cond`s: the large arrays' exact check, the small one's peak.
    assert outer.count("reduce_sum") == 3 and outer.count("cond") == 2, outer
    assert outer.count("sub") == 1 and "abs" not in outer, outer
    assert inner.count("sub") == 2 and inner.count("abs") == 1, inner
    # Without large arrays nor a scale there is nothing to branch on.
    outer, _ = _primitives(jax.make_jaxpr(jax_multi.all_finite)(arrays[2:]).jaxpr)
    assert "cond" not in outer and "abs" not in outer, outer


@pytest.mark.parametrize("scale, finite", [(2.0, True), (1.0, True), (0.5, False)])
def test_a_peak_is_taken_only_below_a_scale_of_1(scale, finite):
    """A finite gradient overflows once unscaled only where the scale is below 1."""
    for n in (3, 4097, 65537):  # a chunk, an array alone
        g = jnp.asarray(np.full(n, 3e38, np.float32))
        assert bool(jax.jit(jax_multi.finite_unscaled)([g], jnp.float32(scale))) is finite


def test_off_the_cpu_every_array_is_checked_exactly_without_a_branch(monkeypatch):
    """No `cond` where XLA would read its predicate back to the host (a GPU)."""
    monkeypatch.setattr(jax_multi, "_SUMMED", 8)
    monkeypatch.setattr(jax_multi, "_SUMS_FIRST_ON", frozenset({"gpu"}))
    arrays = [jnp.ones(16), jnp.asarray([1.0, np.inf] * 8)]
    outer, _ = _primitives(jax.make_jaxpr(jax_multi.finite_unscaled)(arrays, 2.0).jaxpr)
    assert "cond" not in outer, outer
    assert not bool(jax_multi.finite_unscaled(arrays, jnp.float32(2.0)))
    assert bool(jax_multi.finite_unscaled(arrays[:1], jnp.float32(2.0)))


# --- the check by the exact reciprocal (a power-of-two scale) ---------------

# Both sides of the chunk threshold (`PACK_UP_TO`) and of the sums-first one
# (`_SUMMED`), at their real values.
RECIPROCAL_SIZES = (
    jax_multi.PACK_UP_TO,
    jax_multi.PACK_UP_TO + 1,
    jax_multi._SUMMED - 1,
    jax_multi._SUMMED,
)
# Below 1 (where a finite gradient can overflow once unscaled), 1, above,
# and the ends of the range the policy reaches.
RECIPROCAL_EXPONENTS = (-126, -113, -112, -1, 0, 15, 126, 127)


def _largest_unscaled_finite(dtype, scale):
    """The largest value whose float32 quotient by `scale` is finite, and the next one.

    Values of `dtype`; for float64, float32 values (the check is in float32).
    """
    step = np.float32 if dtype == "float64" else dtype
    limit = np.float64(np.finfo(np.float32).max) * scale
    top = np.asarray(min(limit, float(ml_dtypes.finfo(step).max)), np.float64).astype(step)
    while not _exact_flag([top], scale):
        top = np.nextafter(top, np.asarray(0, step))
    with np.errstate(over="ignore"):
        above = np.nextafter(top, np.asarray(np.inf, step))
    return top, (above if np.isfinite(above) else None)


@contextlib.contextmanager
def _dtype_enabled(dtype):
    with jax.enable_x64(dtype == "float64"):
        yield


@pytest.mark.parametrize("size", RECIPROCAL_SIZES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_the_reciprocal_check_is_the_exact_flag(dtype, size, rng):
    """`reciprocal=True` equals `isfinite(max_abs / scale)` for power-of-two scales.

    inf, -inf, NaN and the first value that overflows once unscaled at the
    first, last and a random position, beside the largest that does not,
    in a small array and a large one.
    """
    with _dtype_enabled(dtype):
        check = jax.jit(jax_multi.finite_unscaled, static_argnums=2)
        base = (rng.uniform(0.5, 1.5, size) * rng.choice([-1, 1], size)).astype(dtype)
        small = jnp.asarray(rng.normal(size=7).astype(dtype))
        for k in RECIPROCAL_EXPONENTS:
            scale = np.float32(2.0**k)
            top, above = _largest_unscaled_finite(dtype, scale)
            bad_values = [np.inf, -np.inf, np.nan] + ([] if above is None else [above, -above])
            if dtype == "float64":  # beyond float32's range
                bad_values.append(-1e300)
            positions = (0, size - 1, int(rng.integers(size)))
            cases = [(None, None)] + [(v, i) for v in [top, -top] + bad_values for i in positions]
            for value, position in cases:
                values = base.copy()
                if value is not None:
                    values[position] = value
                arrays = [jnp.asarray(values), small]
                expected = _exact_flag(arrays, scale)
                finite = value is None or bool(np.float64(abs(value)) == top)
                assert expected is finite, (k, value)  # the case is what it says
                got = check(arrays, jnp.float32(scale), True)
                assert bool(got) is expected, (k, value, position)
                # The small array alone carries it too (it is its own chunk).
                got = check([small, jnp.asarray(values[:5])], jnp.float32(scale), True)
                assert bool(got) is _exact_flag([small, values[:5]], scale), (k, value)


def test_the_reciprocal_check_under_vmap(rng):
    """A flag per member, with a scale per member, below and above 1."""
    n = jax_multi.PACK_UP_TO + 1
    big = np.float32(np.finfo(np.float32).max) / 2
    members = np.tile(rng.normal(size=n).astype(np.float32), (4, 1))
    members[1, 17] = np.nan
    members[2, -1] = np.nextafter(big, np.float32(np.inf))  # overflows at 0.5 only
    members[3, 0] = big  # the largest value that does not at 0.5
    scales = np.float32([2.0, 2.0**15, 0.5, 0.5])
    got = jax.jit(jax.vmap(lambda g, s: jax_multi.finite_unscaled([g], s, True)))(
        jnp.asarray(members), jnp.asarray(scales)
    )
    assert np.asarray(got).tolist() == [True, False, False, True]
    # The same members at a scale of at least 1: only the NaN.
    got = jax.vmap(lambda g: jax_multi.finite_unscaled([g], jnp.float32(2.0), True))(members)
    assert np.asarray(got).tolist() == [True, False, True, True]


def test_the_reciprocal_check_has_no_branch_and_no_peak(monkeypatch):
    """One sum of `y - y` per group: no `cond`, no `abs`, and `cond` only for the large sums."""
    arrays = [jnp.ones(9), jnp.ones(3)]
    outer, _ = _primitives(
        jax.make_jaxpr(lambda a, s: jax_multi.finite_unscaled(a, s, True))(
            arrays, jnp.float32(0.5)
        ).jaxpr
    )
    assert "cond" not in outer and "abs" not in outer and "mul" in outer, outer
    monkeypatch.setattr(jax_multi, "_SUMMED", 8)
    outer, inner = _primitives(
        jax.make_jaxpr(lambda a, s: jax_multi.finite_unscaled(a, s, True))(
            arrays, jnp.float32(0.5)
        ).jaxpr
    )
    # The large array's plain sum first; its exact branch has no `cond` of its own.
    assert outer.count("cond") == 1 and "abs" not in outer, outer
    assert "cond" not in inner and "abs" not in inner and "mul" in inner, inner


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("shape", [(1024, 256), (64, 100)])
def test_the_reciprocal_check_holds_no_scratch_buffer(dtype, shape):
    """Same-shaped gradients share no broadcast of the reciprocal (see `_groups_finite`)."""
    with _dtype_enabled(dtype):
        arrays = [jnp.ones(shape, dtype) for _ in range(4)]
        compiled = (
            jax.jit(lambda a, s: jax_multi.finite_unscaled(a, s, True))
            .lower(arrays, jnp.float32(2.0))
            .compile()
        )
        assert compiled.memory_analysis().temp_size_in_bytes < arrays[0].nbytes // 8


def test_global_norm_of_half_precision(rng):
    grads = [rng.normal(size=(3, 2)) * 300, rng.normal(size=4) * 300]
    native = [jnp.asarray(g, jnp.float16) for g in grads]
    expected = np.sqrt(sum((np.asarray(n, np.float64) ** 2).sum() for n in native))
    norm = jax_multi.global_norm(native)
    assert norm.dtype == jnp.float32  # float16 would overflow at ~65504
    np.testing.assert_allclose(float(norm), expected, rtol=1e-6)


@pytest.mark.parametrize("scale", [3.0, 1000.5, 2.0**-3 * 5])
def test_eager_unscale_by_a_scale_no_power_of_two_is_the_correctly_rounded_quotient(scale):
    """Run alone, XLA compiles `g / s` as `g * (1 / s)`: 1 ulp off for ~40 % of elements."""
    rng = np.random.default_rng(0)
    grads = [(rng.normal(size=n) * 3).astype(np.float32) for n in (256, 100_003)]
    s = jnp.asarray(scale, jnp.float32)
    eager = jax_multi.unscale([jnp.asarray(g) for g in grads], s)
    jitted = jax.jit(lambda gs, s: jax_multi.unscale(gs, s))([jnp.asarray(g) for g in grads], s)
    for g, e, j in zip(grads, eager, jitted):
        want = (g.astype(np.float64) / np.float64(np.float32(scale))).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(e), want)
        np.testing.assert_array_equal(np.asarray(j), want)


def test_an_eager_step_by_a_scale_no_power_of_two_equals_the_jitted_one():
    rng = np.random.default_rng(1)
    params = [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in [(64, 33), (33,)]]
    grads = [jnp.asarray((rng.normal(size=p.shape) * 3).astype(np.float32)) for p in params]
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(1.0), initial_scale=3.0)
    opt.build(params)
    values = [v.value for v in opt.variables]
    eager, _ = opt.stateless_apply(values, grads, params)
    jitted, _ = jax.jit(opt.stateless_apply)(values, grads, params)
    for p, g, e, j in zip(params, grads, eager, jitted):
        quotient = (np.asarray(g).astype(np.float64) / 3.0).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(e), np.asarray(p) - quotient)
        np.testing.assert_array_equal(np.asarray(e), np.asarray(j))
