"""mixed_precision/inspection.py: the policy's gradient statistics, against float64 NumPy.

Each gradient's peak is the backend's `max_abs` of it (as the wrapper and
optax take it) at sizes on both sides of the backends' reduction
thresholds; inf, NaN and a finite value that overflows only once unscaled
sit at the edges and at random positions. Then what each interface makes of
the measurement (telemetry's names, the headroom peak) is the same.
"""

import numpy as np
import pytest

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.mixed_precision import inspection
from lossscale.mixed_precision.policy import LossScalePolicy

SIZES = (1, 4097, 65537, 262145)
LIMITS = {"float16": 65504.0, "float32": float(np.finfo(np.float32).max)}


def case(rng, n, dtype, bad, at):
    """A gradient of `n` values of `dtype` (scaled: up to 2^10), `bad` at position `at`."""
    g = rng.standard_normal(n) * 2.0 ** rng.integers(-8, 10, size=n)
    if bad is not None:
        g[{"first": 0, "last": n - 1, "random": int(rng.integers(n))}[at]] = bad
    return g.astype(dtype)


def float64_inspection(grads, dtypes, scale, headroom, details):
    """`(finite, peak, flags)` of numpy gradients, counted in float64."""
    flags, scaled_peaks = [], []
    for g, dtype in zip(grads, dtypes):
        if g.size == 0:
            flags.append(None)
            continue
        a = np.abs(g.astype(np.float64))
        peak = np.nan if np.isnan(a).any() else a.max()
        unscaled = peak if dtype is None else peak / scale
        flags.append(bool(np.isfinite(unscaled) and unscaled <= LIMITS[dtype or "float32"]))
        if dtype is not None:
            scaled_peaks.append(peak)
    finite = all(f for f in flags if f is not None)
    peak = None
    if headroom:
        peak = (
            (np.nan if np.isnan(scaled_peaks).any() else max(scaled_peaks)) if scaled_peaks else 0
        )
    return finite, peak, (tuple(flags) if details else ())


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(
    ("bad", "at"),
    [
        (None, "first"),
        (np.inf, "first"),
        (np.inf, "random"),
        (-np.inf, "last"),
        (np.nan, "first"),
        (np.nan, "random"),
        ("overflows_unscaled", "last"),
        ("overflows_unscaled", "random"),
    ],
)
def test_equals_a_float64_count(backend, size, bad, at):
    rng = np.random.default_rng([size, hash(str(bad)) % 1000, len(at)])
    scale = 0.125  # below 1: a finite scaled value may overflow once unscaled
    dtypes = ["float16", "float32", "float16", None, "float32"]
    grads = [
        case(rng, size, "float16", 6.0e4 if bad == "overflows_unscaled" else bad, at),
        case(rng, size // 2 + 1, "float32", None, at),
        np.zeros(0, np.float16),  # an empty gradient: no peak, no flag
        case(rng, 3, "float32", 1.0e30, at),  # not unscaled: checked as is, not in the peak
        # The second of its dtype: flags are kept in order within a dtype.
        case(rng, 5, "float32", 1.0e38 if bad == "overflows_unscaled" else bad, at),
    ]
    ops = get_ops(backend.name)
    arrays = [backend.array(g) for g in grads]
    peaks = [ops.max_abs([a]) if g.size else None for a, g in zip(arrays, grads)]
    for policy in (
        LossScalePolicy(telemetry=True),
        LossScalePolicy(growth_policy="headroom"),
        LossScalePolicy(telemetry=True, growth_policy="headroom"),
    ):
        details, headroom = policy.records_details, policy.growth_policy == "headroom"
        got = inspection.inspect(ops, peaks, dtypes, ops.asarray(scale, "float32"), policy)
        want = float64_inspection(grads, dtypes, scale, headroom, details)
        assert bool(backend.numpy(got.finite)) == want[0]
        if headroom:
            np.testing.assert_array_equal(backend.numpy(got.peak), np.float32(want[1]))
        else:
            assert got.peak is None
        flags = tuple(None if f is None else bool(backend.numpy(f)) for f in got.variable_finite)
        assert flags == want[2]


def test_no_present_gradient_is_finite_with_a_zero_peak(backend):
    ops = get_ops(backend.name)
    policy = LossScalePolicy(telemetry=True, growth_policy="headroom")
    got = inspection.inspect(
        ops, [None, None], ["float32", None], ops.asarray(8.0, "float32"), policy
    )
    assert bool(backend.numpy(got.finite)) and float(backend.numpy(got.peak)) == 0.0
    assert got.variable_finite == (None, None)


@pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")
def test_the_wrapper_names_a_gradient_that_overflows_only_once_unscaled(backend):
    # float16 values near float16's maximum are finite; divided by a scale
    # below 1 and unscaled to float32 they still are, so only the float32
    # range decides: a float32 gradient of 3e38 at scale 0.5 is one.
    variables = [ls.Variable(backend.array(np.ones(4)), name=n) for n in ("a", "b")]
    opt = ls.LossScaleOptimizer(
        ls.optimizers.SGD(0.1), initial_scale=0.5, telemetry=True, growth_policy="headroom"
    )
    opt.build(variables)
    grads = [backend.array(np.full(4, 1.0)), backend.array(np.array([1.0, 3.0e38, 2.0, 0.0]))]
    opt.apply(grads, variables)
    summary = opt.summary()
    assert summary["skipped_steps"] == 1
    assert summary["overflows"][-1]["variables"] == ["b"]
