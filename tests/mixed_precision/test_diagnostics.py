"""mixed_precision/diagnostics.py: the float16 range of the gradients, and what reports it.

The measurement against a float64 NumPy count of the same values, on every
backend, at sizes on both sides of the backends' reduction thresholds, with
inf and NaN at the edges and at random positions; then what the wrapper
does with it (`diagnostics_every`, `summary()["float16_range"]`), the
overflow window (`history_length`, the loss's own flag), the error message
and `growth_policy="statistics"`. How the wrapper records the loss's flag,
observers, snapshots and the measurement's cadence (and its host reads) is
in tests/optimizers/test_loss_scale_optimizer.py.
"""

import warnings

import numpy as np
import pytest

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.mixed_precision import LossScaleError, diagnostics
from tests.conftest import BACKENDS, Backend

# Both sides of every size a backend's reductions branch on (JAX 4096 and
# 2^18, NumPy's blocks 2^14, torch's packing 2^16).
SIZES = (1, 7, 4095, 4096, 4097, 16385, 65537, 262145)
F16_MAX = 65504.0


def float64_range(g, growth_factor):
    """`(zero, subnormal, near_max, max_abs)` of `g`, counted in float64."""
    a = np.abs(np.asarray(g, np.float64))
    with np.errstate(invalid="ignore"):
        shares = [
            np.count_nonzero(a == 0) / a.size,
            np.count_nonzero((a > 0) & (a < 2.0**-14)) / a.size,
            np.count_nonzero(a >= F16_MAX / growth_factor) / a.size,
        ]
    peak = np.nan if np.isnan(a).any() else a.max()
    return shares + [peak]


def banded(n, rng, dtype):
    """Values in every band: zeros, float16 subnormals, normal values, near float16's max."""
    band = rng.integers(0, 4, n)
    sign = rng.choice([-1.0, 1.0], n)
    value = np.select(
        [band == 0, band == 1, band == 2],
        [0.0, rng.uniform(1e-7, 6e-5, n), rng.uniform(1e-3, 3e4, n)],
        rng.uniform(32752.0, 65504.0, n),
    )
    return (sign * value).astype(dtype)


def assert_range(got, expected, size):
    got = [float(x) for x in got]
    for share_got, share_expected in zip(got[:3], expected[:3]):
        # float32 count over float32 size: exact to float32's rounding.
        assert share_got == pytest.approx(share_expected, rel=2**-22, abs=0.5 / size)
    if np.isnan(expected[3]):
        assert np.isnan(got[3])
    else:
        assert got[3] == np.float32(expected[3])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_measure_matches_a_float64_count(name, dtype):
    backend, ops = Backend(name), get_ops(name)
    rng = np.random.default_rng(3)
    for n in SIZES:
        g = banded(n, rng, dtype)
        for growth in (2.0, 4.0):
            got = diagnostics.measure(ops, backend.array(g, dtype), growth)
            assert_range([backend.numpy(x) for x in got], float64_range(g, growth), n)
        for value in (np.nan, np.inf):
            for position in dict.fromkeys([0, n - 1, n // 2, int(rng.integers(n))]):
                bad = g.copy()
                bad[position] = value
                got = diagnostics.measure(ops, backend.array(bad, dtype), 2.0)
                expected = float64_range(bad, 2.0)
                if value == np.inf:
                    assert float(backend.numpy(got[3])) == np.inf
                    expected[3] = np.inf
                assert_range([backend.numpy(x) for x in got], expected, n)


@pytest.mark.parametrize("name", BACKENDS)
def test_max_abs_is_nan_when_every_element_is(name):
    # XLA's CPU max drops NaN; with every element NaN it returned its start,
    # -inf, which is "finite" to a check of the peak (an all-NaN gradient,
    # what a NaN loss gives, was applied on JAX with telemetry on).
    backend, ops = Backend(name), get_ops(name)
    for n in (1, 4095, 4097, 262145):
        g = backend.array(np.full(n, np.nan, np.float32))
        assert np.isnan(float(backend.numpy(ops.max_abs([g])))), n
        assert np.isnan(float(backend.numpy(diagnostics.measure(ops, g, 2.0)[3]))), n


# --- in the wrapper -------------------------------------------------------------

SHAPES = ((300, 250), (4097,), (7,))


def build(backend, **settings):
    rng = np.random.default_rng(0)
    variables = [
        ls.Variable(backend.array(rng.standard_normal(s).astype(np.float32)), name=f"v{i}")
        for i, s in enumerate(SHAPES)
    ]
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(1e-3), initial_scale=2.0**10, **settings)
    opt.build(variables)
    return variables, opt


def scaled_grads(rng, scale):
    return [(banded(int(np.prod(s)), rng, np.float32).reshape(s) * 1e-4) * scale for s in SHAPES]


@pytest.mark.parametrize("name", BACKENDS)
def test_summary_holds_the_last_measured_step(name):
    backend = Backend(name)
    variables, opt = build(backend, diagnostics_every=3)
    rng = np.random.default_rng(1)
    measured = {}
    for step in range(8):
        grads = scaled_grads(rng, float(opt.dynamic_scale))
        if step % 3 == 0:
            measured = {f"v{i}": float64_range(g, 2.0) for i, g in enumerate(grads)}
        opt.scale_loss(1.0)
        opt.apply([backend.array(g) for g in grads], variables)
    summary = opt.summary()
    assert summary["float16_range_step"] == 6
    assert list(summary["float16_range"]) == ["v0", "v1", "v2"]
    for path, got in summary["float16_range"].items():
        assert_range([got[k] for k in diagnostics.KEYS], measured[path], 75000)
    # Off by default, and no telemetry keys come with the measurement alone.
    assert "float16_range" not in build(backend)[1].summary()
    assert "overflows" not in summary


def test_a_jitted_stateless_step_measures_as_the_eager_one():
    import jax

    backend = Backend("jax")
    variables, eager = build(backend, diagnostics_every=2, telemetry=True)
    _, functional = build(backend, diagnostics_every=2, telemetry=True)
    step = jax.jit(functional.stateless_apply)
    values, model = [v.value for v in functional.variables], [v.value for v in variables]
    rng = np.random.default_rng(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(5):
            grads = scaled_grads(rng, float(eager.dynamic_scale))
            if k == 3:
                grads[1][17] = np.inf
            grads = [backend.array(g) for g in grads]
            eager.apply(grads, variables)
            model, values = step(values, grads, model)
    assert functional.summary(values) == eager.summary()
    assert eager.summary()["float16_range_step"] == 4


@pytest.mark.parametrize("name", BACKENDS)
def test_the_overflow_window_keeps_each_overflow_and_its_loss(name):
    backend = Backend(name)
    variables, opt = build(backend, telemetry=True, history_length=3)
    rng = np.random.default_rng(4)
    # (variables with an inf, the loss): five overflows, finite steps between.
    plan = [((0,), 1.0), ((), 1.0), ((1, 2), np.nan), ((2,), 1.0), ((), 1.0)]
    plan += [((0, 1), np.inf), ((1,), 2.0)]
    for bad, loss in plan:
        grads = scaled_grads(rng, float(opt.dynamic_scale))
        for i in bad:
            grads[i].flat[int(rng.integers(grads[i].size))] = np.nan
        opt.scale_loss(backend.array(np.float32(loss)))
        opt.apply([backend.array(g) for g in grads], variables)
    summary = opt.summary()
    record = dict(module=None)
    assert summary["overflows"] == [
        {"step": 3, "cause": "overflow", "variables": ["v2"], "loss_finite": True, **record},
        {
            "step": 5,
            "cause": "nonfinite_loss",
            "variables": ["v0", "v1"],
            "loss_finite": False,
            **record,
        },
        {"step": 6, "cause": "overflow", "variables": ["v1"], "loss_finite": True, **record},
    ]
    assert len(summary["scale_history"]) == 3
    assert [v.name for v in opt.variables if v.name.startswith("overflow_steps")] == [
        "overflow_steps_0",
        "overflow_steps_1",
        "overflow_steps_2",
    ]


@pytest.mark.parametrize("name", BACKENDS)
def test_the_error_tells_a_nan_loss_from_an_overflow(name):
    backend = Backend(name)
    variables, opt = build(backend, max_consecutive_skips=1)
    rng = np.random.default_rng(5)
    grads = scaled_grads(rng, float(opt.dynamic_scale))
    opt.scale_loss(backend.array(np.float32(np.nan)))
    opt.apply([backend.array(g * np.nan) for g in grads], variables)
    grads[2][3] = np.inf
    opt.scale_loss(backend.array(np.float32(0.5)))
    with pytest.raises(LossScaleError) as info:
        opt.apply([backend.array(g) for g in grads], variables)
    message = str(info.value)
    assert message.startswith(
        "Loss scaling failed at step 1: overflow: gradients of 1 variable (v2) overflowed at "
        "step 1 (the loss was finite); backing off the scale clears an overflow."
    )
    assert "  step 0: nonfinite_loss, loss NaN/inf; non-finite: 3 variables (v0, v1, v2)" in message
    assert "  step 1: overflow, loss finite; non-finite: 1 variable (v2)" in message


# --- growth_policy="statistics" ------------------------------------------------


def run_float16_training(growth_policy, steps=3000, seed=0):
    """Float16 gradients of a drifting magnitude, scaled then rounded as in training.

    Returns the number of skipped steps and the scales taken.
    """
    rng = np.random.default_rng(seed)
    w = ls.Variable(np.zeros(2048, np.float32), name="w")
    settings = dict(growth_policy=growth_policy, telemetry=True, dynamic_growth_steps=200)
    if growth_policy == "statistics":
        settings["diagnostics_every"] = 10
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.0), initial_scale=2.0**15, **settings)
    opt.build([w])
    scales = []
    for step in range(steps):
        # The largest true gradient drifts over three orders of magnitude,
        # with an occasional spike to twice its size.
        peak = 10.0 ** (1.5 * np.sin(step / 400.0)) * (2.0 if rng.random() < 0.01 else 1.0)
        g = rng.standard_normal(2048) * peak / 4
        scale = float(opt.dynamic_scale)
        with np.errstate(over="ignore"):
            scaled = (g * scale).astype(np.float16)  # overflows to inf as float16 does
        opt.scale_loss(1.0)
        opt.apply([scaled], [w])
        scales.append(float(opt.dynamic_scale))
    return opt.summary()["skipped_steps"], scales


def test_the_statistics_policy_skips_fewer_steps_and_keeps_the_scale_normal():
    fixed, _ = run_float16_training("fixed")
    statistics, scales = run_float16_training("statistics")
    # Fixed: every growth (each 200 finite steps) that leaves no room overflows.
    assert statistics <= fixed / 3, (statistics, fixed)
    tiny, largest = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    assert all(tiny <= s <= largest for s in scales)


def test_the_statistics_policy_needs_the_measurement():
    with pytest.raises(ValueError, match="set `diagnostics_every`"):
        ls.LossScaleOptimizer(ls.optimizers.SGD(), growth_policy="statistics")
