"""The demo's training loop: measurement of underflow, skipped steps, the loss weight,
the float16 range recorded at the measured steps, and the two growth policies."""

import numpy as np
import pytest

from lossscale.backends import get_ops
from lossscale.demo import data as digits
from lossscale.demo.config import DemoConfig
from lossscale.demo.models import make_model, single_threaded
from lossscale.demo.training import RUNS, RunResult, _compare, make_optimizer, train_run
from lossscale.optimizers import Adam, LossScaleOptimizer

FLOAT32, UNSCALED, SCALED, STATISTICS = RUNS
RANGE_KEYS = {"zero", "subnormal", "near_max", "max_abs"}


class RecordingBar:
    def __init__(self):
        self.updates, self.postfixes, self.closed = 0, [], 0

    def update(self, n):
        self.updates += n

    def set_postfix_str(self, text, refresh=True):
        self.postfixes.append(text)

    def close(self):
        self.closed += 1


@pytest.fixture(scope="module")
def data():
    return digits.load_digits(0)


def _train(spec, backend, data, steps, **config):
    config = DemoConfig(steps=steps, backend=backend, hidden_units=16, **config)
    batches = digits.batch_indices(len(data.y_train), config.batch_size, steps, 0)
    model = make_model(backend, digits.initial_weights(0, 16))
    bar = RecordingBar()
    with single_threaded(backend):
        return train_run(spec, model, data, batches, config, bar), bar


def test_compare_counts_flushed_and_subnormal_values_and_the_relative_error():
    ops = get_ops("numpy")
    reference = [np.array([1e-3, -2e-3, 0.0, 4e-8], np.float32), np.array([[3e-3]], np.float32)]
    grads = [np.array([2.0, -4.0, 0.0, 0.0], np.float16), np.array([[6.0]], np.float16)]
    flushed, nonzero, subnormal, received, error = _compare(reference, grads, 2048.0, ops)
    assert (flushed, nonzero, subnormal, received) == (1, 4, 0, 3)
    ref64 = [r.astype(np.float64) for r in reference]
    unscaled = [g.astype(np.float64) / 2048.0 for g in grads]
    expected = np.sqrt(sum(((u - r) ** 2).sum() for u, r in zip(unscaled, ref64))) / np.sqrt(
        sum((r**2).sum() for r in ref64)
    )
    assert error == pytest.approx(expected, rel=1e-12)


def test_compare_counts_subnormals_below_two_to_the_minus_14():
    ops = get_ops("numpy")
    grads = [np.array([2.0**-14, -(2.0**-15), 2.0**-24, 0.0, 1.0], np.float16)]
    comparison = _compare([np.ones(5, np.float32)], grads, 1.0, ops)
    assert (comparison.subnormal, comparison.received_nonzero, comparison.flushed) == (2, 4, 1)


def test_compare_leaves_out_the_error_of_an_overflowed_step():
    ops = get_ops("numpy")
    comparison = _compare(
        [np.array([1.0, 2.0, 1e-9], np.float32)],
        [np.array([np.inf, 1.0, 0.0], np.float16)],
        1.0,
        ops,
    )
    assert (comparison.flushed, comparison.nonzero, comparison.error) == (1, 3, None)


def test_make_optimizer_scales_epsilon_with_the_loss_weight():
    config = DemoConfig(
        loss_weight=2.0**-10, initial_scale=2.0**12, growth_steps=7, learning_rate=0.01
    )
    plain = make_optimizer(UNSCALED, config)
    assert type(plain) is Adam
    assert plain.epsilon == 1e-7 * 2.0**-10
    assert float(plain.learning_rate) == pytest.approx(0.01)
    wrapped = make_optimizer(SCALED, config)
    assert isinstance(wrapped, LossScaleOptimizer)
    assert (wrapped.initial_scale, wrapped.dynamic_growth_steps) == (2.0**12, 7)
    assert wrapped.inner_optimizer.epsilon == 1e-7 * 2.0**-10
    assert (wrapped.policy.growth_policy, wrapped.policy.diagnostics_every) == ("fixed", 50)
    statistics = make_optimizer(STATISTICS, DemoConfig(diagnostics_every=3))
    assert (statistics.policy.growth_policy, statistics.policy.diagnostics_every) == (
        "statistics",
        3,
    )


def test_float32_run_is_the_same_for_any_power_of_two_loss_weight(backend, data):
    plain, _ = _train(FLOAT32, backend.name, data, 8, loss_weight=1.0)
    weighted, _ = _train(FLOAT32, backend.name, data, 8, loss_weight=2.0**-16)
    assert plain.losses == weighted.losses
    assert (plain.train_loss, plain.test_accuracy) == (weighted.train_loss, weighted.test_accuracy)
    assert plain.flush_share is None and plain.gradient_error is None
    assert plain.scales == [None] * 8 and plain.final_scale is None


def test_unscaled_float16_run_records_underflow(backend, data):
    result, bar = _train(UNSCALED, backend.name, data, 6)
    assert result.nonzero > 0 and 0 < result.flushed <= result.nonzero
    assert 0 < result.subnormal <= result.received_nonzero <= result.nonzero
    assert len(result.gradient_errors) == 6
    assert result.skipped_steps == [] and result.final_scale is None
    assert (bar.updates, bar.closed, len(bar.postfixes)) == (6, 1, 6)
    assert bar.postfixes[-1].endswith("scale=-")


def test_too_large_a_scale_skips_steps_and_halves_the_scale(backend, data):
    result, bar = _train(SCALED, backend.name, data, 8, initial_scale=2.0**38)
    skipped = result.skipped_steps
    assert skipped == list(range(len(skipped))) and 0 < len(skipped) < 8
    assert result.scales[: len(skipped) + 1] == [2.0 ** (38 - i) for i in range(len(skipped) + 1)]
    assert result.scales[len(skipped) :] == [result.scales[len(skipped)]] * (8 - len(skipped))
    assert result.final_scale == result.scales[-1]
    # Overflowed steps carry no error measurement; the others do.
    assert len(result.gradient_errors) == 8 - len(skipped)
    assert bar.postfixes[0].endswith(f"scale={2.0**38:g}")


def test_scale_grows_every_growth_steps(data):
    result, _ = _train(SCALED, "numpy", data, 9, initial_scale=2.0**10, growth_steps=4)
    assert result.skipped_steps == []
    assert result.scales == [2.0**10] * 4 + [2.0**11] * 4 + [2.0**12]
    assert result.final_scale == 2.0**12


def test_run_result_summaries():
    result = RunResult(
        SCALED, flushed=3, nonzero=12, subnormal=1, received_nonzero=8, gradient_errors=[0.1, 0.3]
    )
    assert result.flush_share == 0.25 and result.subnormal_share == 0.125
    assert result.gradient_error == pytest.approx(0.2)
    as_dict = result.to_dict()
    assert as_dict["flush_share"] == 0.25 and as_dict["spec"]["label"] == SCALED.label
    assert as_dict["subnormal_share"] == 0.125
    empty = RunResult(FLOAT32)
    assert empty.flush_share is None and empty.gradient_error is None
    assert empty.subnormal_share is None


@pytest.mark.parametrize("spec", [SCALED, STATISTICS], ids=["fixed", "statistics"])
def test_loss_scaled_runs_record_the_float16_range_at_the_measured_steps(backend, data, spec):
    result, _ = _train(spec, backend.name, data, 11, diagnostics_every=5)
    assert [e["step"] for e in result.float16_range] == [0, 5, 10]
    for entry in result.float16_range:
        assert list(entry["range"]) == ["w1", "b1", "w2", "b2"]
        for measured in entry["range"].values():
            assert set(measured) == RANGE_KEYS
            shares = [measured[k] for k in ("zero", "subnormal", "near_max")]
            assert all(0 <= x <= 1 for x in shares) and sum(shares) <= 1
            assert 0 < measured["max_abs"] < np.inf
    # The first step's scale is the initial one and the weights are shared:
    # both policies measure the same gradients there.
    fixed, _ = _train(SCALED, backend.name, data, 1, diagnostics_every=5)
    assert result.float16_range[0] == fixed.float16_range[0]


def test_runs_without_loss_scaling_measure_nothing(data):
    for spec in (FLOAT32, UNSCALED):
        result, _ = _train(spec, "numpy", data, 3, diagnostics_every=1)
        assert result.float16_range == []


def test_a_measured_overflow_is_recorded_as_such(data):
    # At 2^34 the gradients overflow from step 20 on (steps 20 and 31 below).
    result, _ = _train(
        SCALED, "numpy", data, 32, initial_scale=2.0**34, growth_steps=10, diagnostics_every=10
    )
    assert result.skipped_steps[:2] == [20, 31]
    by_step = {e["step"]: e["range"] for e in result.float16_range}
    assert max(m["max_abs"] for m in by_step[20].values()) == np.inf
    assert all(m["max_abs"] < np.inf for m in by_step[10].values())


def test_the_statistics_policy_skips_fewer_steps_than_the_fixed_one(backend, data):
    # Started near the overflow edge and growing every 10 steps, the fixed
    # policy overflows after most growths; "statistics" backs off or holds
    # before that, deciding every 10 steps.
    settings = dict(initial_scale=2.0**34, growth_steps=10, diagnostics_every=10)
    fixed, _ = _train(SCALED, backend.name, data, 60, **settings)
    statistics, _ = _train(STATISTICS, backend.name, data, 60, **settings)
    assert len(fixed.skipped_steps) >= 4
    assert len(statistics.skipped_steps) < len(fixed.skipped_steps) / 4
    tiny, largest = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    assert all(tiny <= s <= largest for s in statistics.scales)
