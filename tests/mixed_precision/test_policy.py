"""`LossScalePolicy`: its checks and messages, and what it derives once at construction."""

import dataclasses
import math

import numpy as np
import pytest

from lossscale.mixed_precision import LossScalePolicy
from lossscale.mixed_precision import loss_scale as ls_module
from lossscale.mixed_precision import policy as policy_module
from tests.reference import F32_MAX, F32_TINY


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"initial_scale": 0}, "`initial_scale` must be a finite number > 0"),
        ({"initial_scale": F32_MAX * 2}, "`initial_scale` must be a finite number > 0 and <= "),
        # Subnormal in float32: 1 / scale overflows, as every gradient divided by it.
        (
            {"initial_scale": 1e-45},
            r"`initial_scale` must be at least 2\*\*-126 \(1.17549e-38\), float32's smallest "
            r"normal number: a subnormal scale overflows every gradient divided by it. "
            r"Received: initial_scale=1e-45",
        ),
        ({"initial_scale": 2.0**-127}, r"Received: initial_scale=5.877471754111438e-39"),
        (
            {"dynamic_growth_steps": 0},
            "`dynamic_growth_steps` must be an integer >= 1. Received: dynamic_growth_steps=0",
        ),
        (
            {"growth_factor": 1.0},
            "`growth_factor` must be a finite number > 1. Received: growth_factor=1.0",
        ),
        (
            {"backoff_factor": 1.0},
            "`backoff_factor` must be a finite number > 0 and < 1. Received: backoff_factor=1.0",
        ),
    ],
)
def test_policy_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScalePolicy(**kwargs)


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LossScalePolicy().initial_scale = 3.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hysteresis": 0}, "`hysteresis` must be an integer >= 1. Received: hysteresis=0"),
        ({"hysteresis": 1.5}, "Received: hysteresis=1.5"),
        (
            {"min_scale": 0.0},
            r"`min_scale` must be a finite number >= 1.17549\d*e-38 and <= "
            r"3.40282\d*e\+38 or None. Received: min_scale=0.0",
        ),
        ({"max_scale": float("inf")}, "Received: max_scale=inf"),
        (
            {"max_consecutive_skips": -1},
            "`max_consecutive_skips` must be an integer >= 0 or None. "
            "Received: max_consecutive_skips=-1",
        ),
        (
            {"growth_policy": "adaptive"},
            r"`growth_policy` must be one of \('fixed', 'headroom', 'statistics'\). "
            "Received: growth_policy='adaptive'",
        ),
        ({"telemetry": 1}, "`telemetry` must be a boolean. Received: telemetry=1"),
        (
            {"diagnostics_every": 0},
            "`diagnostics_every` must be an integer >= 1 or None. Received: diagnostics_every=0",
        ),
        (
            {"history_length": 31},
            "`history_length` must be an integer >= 1 and <= 30. Received: history_length=31",
        ),
        (
            {"growth_policy": "statistics"},
            r'`growth_policy="statistics"` decides from the measured float16 range: set '
            r"`diagnostics_every` \(for example 100\) as well. Received: "
            r'growth_policy="statistics", diagnostics_every=None',
        ),
        (
            {"min_scale": 2.0**16},
            r"`min_scale` <= `initial_scale` <= `max_scale` and `min_scale` "
            r"< `max_scale`. Received: min_scale=65536.0, "
            r"initial_scale=32768.0, max_scale=None",
        ),
        ({"max_scale": 1.0}, "Received: min_scale=None, initial_scale=32768.0, max_scale=1.0"),
        (
            {"initial_scale": 4.0, "min_scale": 4.0, "max_scale": 4.0},
            "Received: min_scale=4.0, initial_scale=4.0, max_scale=4.0",
        ),
    ],
)
def test_new_policy_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScalePolicy(**kwargs)


def test_tracked_fields_follow_the_policy():
    names = lambda policy: [f.name for f in ls_module.state_fields(policy)]  # noqa: E731
    assert names(LossScalePolicy()) == ["scale", "counter"]
    assert names(LossScalePolicy(hysteresis=2)) == ["scale", "counter", "consecutive_skips"]
    telemetry = [
        "scale",
        "counter",
        "consecutive_skips",
        "steps",
        "skipped",
        "last_overflow_step",
        "scale_history",
        "nonfinite",
    ]
    causes = ["streak_scale", "persistent_step"]
    window = ["loss_finite", "overflow_steps", "overflow_loss", "overflow_cause", "overflow_bits"]
    assert names(LossScalePolicy(telemetry=True)) == telemetry + causes + window
    failing = telemetry + ["error", "error_step"] + causes + window
    assert names(LossScalePolicy(max_consecutive_skips=3)) == failing
    assert names(LossScalePolicy(min_scale=1.0)) == failing
    measured = ["range_zero", "range_subnormal", "range_near_max", "range_max_abs", "range_step"]
    assert names(LossScalePolicy(diagnostics_every=5)) == ["scale", "counter", "steps"] + measured
    assert LossScalePolicy(diagnostics_every=5).is_plain  # the step count beside the kernel
    assert not LossScalePolicy(diagnostics_every=5, growth_policy="statistics").is_plain


def test_non_default_settings():
    assert LossScalePolicy().non_default_settings() == {
        "initial_scale": 2.0**15,
        "dynamic_growth_steps": 2000,
    }
    assert LossScalePolicy(hysteresis=2, telemetry=True).non_default_settings() == {
        "initial_scale": 2.0**15,
        "dynamic_growth_steps": 2000,
        "hysteresis": 2,
        "telemetry": True,
    }


def test_plain_policies_are_keras_with_float32_factors_at_most():
    assert LossScalePolicy().is_plain
    assert LossScalePolicy(growth_factor=4.0, backoff_factor=0.25).is_plain
    for kwargs in [
        dict(hysteresis=2),
        dict(telemetry=True),
        dict(min_scale=1.0),
        dict(max_scale=2.0**20),
        dict(max_consecutive_skips=3),
        dict(growth_policy="headroom"),
        dict(backoff_factor=0.7),
        dict(growth_factor=1.1),
    ]:
        assert not LossScalePolicy(**kwargs).is_plain, kwargs


def test_the_limits_are_float32s_and_float16s():
    assert policy_module.MIN_SCALE == F32_TINY == 2.0**-126
    assert policy_module.MAX_SCALE == F32_MAX
    assert policy_module.FLOAT16_MAX == 65504.0
    assert np.float32(policy_module.MIN_SCALE) > 0
    assert policy_module.GROWTH_POLICIES == ("fixed", "headroom", "statistics")


def test_the_scale_limits_are_inclusive():
    assert LossScalePolicy(initial_scale=F32_MAX).initial_scale == F32_MAX
    assert LossScalePolicy(initial_scale=1.0, min_scale=F32_TINY).min_scale == F32_TINY
    assert LossScalePolicy(initial_scale=4.0, min_scale=4.0, max_scale=8.0).max_scale == 8.0
    with pytest.raises(ValueError, match=r"Received: min_scale=1e-39"):
        LossScalePolicy(initial_scale=1.0, min_scale=1e-39)


@pytest.mark.parametrize(
    "kwargs, fails_fast, records_details, diagnoses",
    [
        ({}, False, False, False),
        ({"telemetry": True}, False, True, False),
        ({"min_scale": 1.0}, True, True, False),
        ({"max_consecutive_skips": 0}, True, True, False),
        ({"diagnostics_every": 3}, False, False, True),
        ({"hysteresis": 3}, False, False, False),
    ],
)
def test_what_a_policy_asks_of_a_step(kwargs, fails_fast, records_details, diagnoses):
    policy = LossScalePolicy(**kwargs)
    assert policy.fails_fast is fails_fast
    assert policy.records_details is records_details
    assert policy.diagnoses is diagnoses


def reachable_scales(policy, moves=40):
    """Every scale `moves` growths and backoffs can reach, in float64 (capped and floored)."""
    high = policy.max_scale if policy.max_scale is not None else F32_MAX
    seen, frontier = set(), {policy.initial_scale}
    for _ in range(moves):
        seen |= frontier
        frontier = {
            s
            for x in frontier
            for s in (min(x * policy.growth_factor, high), max(x * policy.backoff_factor, F32_TINY))
            if s <= F32_MAX
        } - seen
    return seen


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, True),
        ({"initial_scale": 1.0, "growth_factor": 4.0, "backoff_factor": 0.25}, True),
        ({"initial_scale": 2.0**-126}, True),
        ({"initial_scale": 3.0}, False),
        ({"growth_factor": 3.0}, False),
        ({"backoff_factor": 0.75}, False),
        ({"max_scale": 2.0**20}, True),
        ({"max_scale": 3.0 * 2.0**20}, False),
    ],
)
def test_scales_are_powers_of_two_when_every_reachable_scale_is(kwargs, expected):
    policy = LossScalePolicy(**kwargs)
    assert policy.scales_are_powers_of_two is expected
    reached = reachable_scales(policy)
    powers = all(s >= F32_TINY and math.frexp(s)[0] == 0.5 for s in reached)
    assert powers is expected
    if expected:  # then `x * (1 / scale)` is `x / scale`, bit for bit
        x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 1e4
        with np.errstate(over="ignore"):  # x / 2^-126 overflows, both ways alike
            for s in reached:
                s32 = np.float32(s)
                np.testing.assert_array_equal(x * (np.float32(1) / s32), x / s32)


def test_state_fields_are_those_tracked_in_declaration_order():
    every = [f.name for f in dataclasses.fields(ls_module.LossScaleState)]
    for kwargs in [{}, {"hysteresis": 2}, {"telemetry": True}, {"diagnostics_every": 1}]:
        policy = LossScalePolicy(**kwargs)
        names = [f.name for f in policy_module.state_fields(policy)]
        assert names == [n for n in every if policy.tracks(n)]
        assert [n for n, _, _ in policy._starts] == names
    with pytest.raises(KeyError):
        LossScalePolicy().tracks("no_such_field")
