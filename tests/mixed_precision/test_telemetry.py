"""`lossscale.mixed_precision.telemetry`: summary dicts and the failure message."""

import warnings

import numpy as np
import pytest

from lossscale.mixed_precision import (
    LossScaleError,
    LossScalePolicy,
    UnscaledLossWarning,
    loss_scale,
    telemetry,
)


def values(**overrides):
    base = dict(
        scale=np.float32(2.0),
        counter=np.int64(3),
        consecutive_skips=np.int64(2),
        steps=np.int64(5),
        skipped=np.int64(2),
        last_overflow_step=np.int64(4),
        scale_history=[np.float32(0.0)] * 3 + [np.float32(s) for s in (8, 8, 4, 2, 2)],
        nonfinite=[np.bool_(False), np.bool_(True), np.bool_(True)],
        error=np.int64(loss_scale.BELOW_MIN_SCALE),
        error_step=np.int64(4),
        loss_finite=np.int64(-1),
        # Two overflows in the window: step 2 (the loss NaN), step 4 (a, c).
        overflow_steps=[np.int64(-1)] * 6 + [np.int64(2), np.int64(4)],
        overflow_loss=[np.int64(-1)] * 6 + [np.int64(0), np.int64(1)],
        overflow_bits=[np.int64(1), np.int64(2), np.int64(3)],
    )
    base.update(overrides)
    return base


def test_summary_of_a_keras_policy_has_only_keras_state():
    summary = telemetry.summarize(values(), LossScalePolicy(), ["a", "b", "c"])
    assert summary == {"dynamic_scale": 2.0, "step_counter": 3}
    assert type(summary["dynamic_scale"]) is float and type(summary["step_counter"]) is int


def test_summary_with_every_field():
    policy = LossScalePolicy(min_scale=1.0)
    assert telemetry.summarize(values(), policy, ["a", "b", "c"]) == {
        "dynamic_scale": 2.0,
        "step_counter": 3,
        "consecutive_skips": 2,
        "steps": 5,
        "skipped_steps": 2,
        "last_overflow_step": 4,
        "scale_history": [8.0, 8.0, 4.0, 2.0, 2.0],
        "nonfinite_variables": ["b", "c"],
        "error": "the loss scale would fall below `min_scale`",
        "error_step": 4,
        "overflows": [
            {"step": 2, "variables": ["b", "c"], "module": None, "loss_finite": False},
            {"step": 4, "variables": ["a", "c"], "module": None, "loss_finite": True},
        ],
    }


def test_summary_before_any_overflow():
    policy = LossScalePolicy(max_consecutive_skips=3)
    summary = telemetry.summarize(
        values(
            steps=np.int64(0),
            last_overflow_step=np.int64(-1),
            error=np.int64(0),
            error_step=np.int64(-1),
            nonfinite=[],
            overflow_steps=[np.int64(-1)] * 8,
            overflow_bits=[],
        ),
        policy,
        [],
    )
    assert summary["scale_history"] == [] and summary["last_overflow_step"] is None
    assert summary["error"] is None and summary["error_step"] is None
    assert summary["nonfinite_variables"] == []


def test_summary_history_is_the_last_steps_only():
    history = [np.float32(s) for s in range(1, 9)]
    summary = telemetry.summarize(
        values(steps=np.int64(20), scale_history=history),
        LossScalePolicy(telemetry=True),
        ["a", "b", "c"],
    )
    assert summary["scale_history"] == [float(s) for s in range(1, 9)]


def test_failure_message_for_each_reason():
    policy = LossScalePolicy(max_consecutive_skips=2, hysteresis=2)
    summary = telemetry.summarize(
        values(error=np.int64(loss_scale.TOO_MANY_SKIPS)),
        policy,
        ["dense/kernel", "dense/bias", "out/kernel"],
    )
    message = telemetry.failure_message(summary, policy)
    assert message.splitlines()[:4] == [
        "Loss scaling failed at step 4: more than `max_consecutive_skips` steps in a row were "
        "skipped (min_scale=None, max_consecutive_skips=2, hysteresis=2, backoff_factor=0.5).",
        "Steps skipped in a row: 2; in total: 2 of 5.",
        "Loss scale of the last steps, oldest first: [8, 8, 4, 2, 2]; now 2.",
        "Variables whose gradients were non-finite at that step: ['dense/bias', 'out/kernel'].",
    ]
    summary = telemetry.summarize(
        values(nonfinite=[np.bool_(False)] * 3), LossScalePolicy(min_scale=0.5), ["a", "b", "c"]
    )
    message = telemetry.failure_message(summary, LossScalePolicy(min_scale=0.5))
    assert "would fall below `min_scale` (min_scale=0.5," in message
    assert (
        "non-finite at that step: none (the overflow came from gradients of variables " in message
    )


def test_as_numpy_reads_tuples_and_scalars(backend):
    from lossscale.backends import get_ops

    out = telemetry.as_numpy(
        get_ops(backend.name),
        {
            "scale": backend.array(np.float32(4.0)),
            "history": (backend.array(np.float32(1.0)), backend.array(np.float32(2.0))),
        },
    )
    assert out["scale"] == 4.0 and [float(x) for x in out["history"]] == [1.0, 2.0]
    assert isinstance(out["scale"], np.ndarray)


def test_error_and_warning_types():
    assert issubclass(LossScaleError, RuntimeError)
    assert issubclass(UnscaledLossWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=UnscaledLossWarning)
        warnings.warn("x", UnscaledLossWarning, stacklevel=1)
    with pytest.raises(LossScaleError):
        raise LossScaleError("x")


def test_unscaled_loss_message():
    message = telemetry.unscaled_loss_message("ls", 32768.0)
    assert message.startswith(
        "LossScaleOptimizer 'ls' is applying gradients, but its "
        "`scale_loss()` was never called: the gradients are divided by "
        "the loss scale (32768 at the start)"
    )
    assert "warnings.filterwarnings('ignore', category=lossscale.mixed_precision." in message
