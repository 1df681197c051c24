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
        streak_scale=np.float32(4.0),
        persistent_step=np.int64(-1),
        loss_finite=np.int64(-1),
        # Two overflows in the window: step 2 (the loss NaN), step 4 (a, c).
        overflow_steps=[np.int64(-1)] * 6 + [np.int64(2), np.int64(4)],
        overflow_loss=[np.int64(-1)] * 6 + [np.int64(0), np.int64(1)],
        overflow_cause=[np.int64(-1)] * 6 + [np.int64(1), np.int64(0)],
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
        "persistent_step": None,
        "last_step_skipped": True,  # the last overflow is the last step's
        "overflows": [
            {
                "step": 2,
                "cause": "nonfinite_loss",
                "variables": ["b", "c"],
                "module": None,
                "loss_finite": False,
            },
            {
                "step": 4,
                "cause": "overflow",
                "variables": ["a", "c"],
                "module": None,
                "loss_finite": True,
            },
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


def test_failure_message_names_the_cause_first():
    policy = LossScalePolicy(max_consecutive_skips=2, hysteresis=2)
    summary = telemetry.summarize(
        values(error=np.int64(loss_scale.TOO_MANY_SKIPS)),
        policy,
        ["dense/kernel", "dense/bias", "out/kernel"],
    )
    message = telemetry.failure_message(summary, policy, variable_count=3)
    assert message.splitlines()[:6] == [
        "Loss scaling failed at step 4: overflow: gradients of 2 variables (dense/kernel, "
        "out/kernel) overflowed at step 4 (the loss was finite); backing off the scale clears "
        "an overflow.",
        "Stopped because more than `max_consecutive_skips` steps in a row were skipped "
        "(min_scale=None, max_consecutive_skips=2, hysteresis=2, backoff_factor=0.5). Steps "
        "skipped in a row: 2; in total: 2 of 5.",
        "Loss scale of the last steps, oldest first: [8, 8, 4, 2, 2]; now 2.",
        "Overflows of the last steps, oldest first:",
        "  step 2: nonfinite_loss, loss NaN/inf; non-finite: 2 variables (dense/bias, out/kernel)",
        "  step 4: overflow, loss finite; non-finite: 2 variables (dense/kernel, out/kernel)",
    ]
    summary = telemetry.summarize(
        values(nonfinite=[np.bool_(False)] * 3), LossScalePolicy(min_scale=0.5), ["a", "b", "c"]
    )
    message = telemetry.failure_message(summary, LossScalePolicy(min_scale=0.5))
    assert "Stopped because the loss scale would fall below `min_scale` (min_scale=0.5," in message


@pytest.mark.parametrize(
    "cause, loss, names, expected",
    [
        (
            loss_scale.NONFINITE_LOSS,
            0,
            1,
            "nonfinite_loss: the loss itself was NaN or inf at step 4; look at the data",
        ),
        (loss_scale.OVERFLOW, 1, 1, "overflow: gradients of 1 variable (v0) overflowed at step 4"),
        # Every variable non-finite, the loss finite: the scale itself.
        (
            loss_scale.OVERFLOW,
            1,
            3,
            "overflow: every variable's gradient was non-finite at step 4 while the loss was "
            "finite: the scale (2) is too high for this loss",
        ),
        (
            loss_scale.PERSISTENT,
            1,
            2,
            "persistent: the same 2 variables (v0, v1) stayed non-finite through back-offs since "
            "step 4, down to scale 2; backing off cannot help",
        ),
    ],
)
def test_the_diagnosis_of_each_cause(cause, loss, names, expected):
    window = dict(
        overflow_steps=[np.int64(-1)] * 7 + [np.int64(4)],
        overflow_loss=[np.int64(-1)] * 7 + [np.int64(loss)],
        overflow_cause=[np.int64(-1)] * 7 + [np.int64(cause)],
        overflow_bits=[np.int64(i < names) for i in range(3)],
        persistent_step=np.int64(3 if cause == loss_scale.PERSISTENT else -1),
    )
    summary = telemetry.summarize(
        values(**window), LossScalePolicy(telemetry=True), ["v0", "v1", "v2"]
    )
    assert summary["overflows"][-1]["cause"] == loss_scale.CAUSES[cause]
    assert telemetry.diagnosis(summary, variable_count=3).startswith(expected)


def test_a_message_stays_short_on_a_large_model():
    # 148 variables, a full window of 30 overflows, each naming all of them.
    paths = [f"block{i // 4}/layer{i % 4}/kernel" for i in range(148)]
    policy = LossScalePolicy(min_scale=1.0, history_length=30)
    summary = telemetry.summarize(
        values(
            steps=np.int64(40),
            scale_history=[np.float32(2.0)] * 30,
            nonfinite=[np.bool_(True)] * 148,
            overflow_steps=[np.int64(s) for s in range(10, 40)],
            overflow_loss=[np.int64(0)] * 15 + [np.int64(1)] * 15,
            overflow_cause=[np.int64(1)] * 15 + [np.int64(2)] * 15,
            overflow_bits=[np.int64(2**30 - 1)] * 148,
            persistent_step=np.int64(25),
            error_step=np.int64(39),
        ),
        policy,
        paths,
    )
    message = telemetry.failure_message(summary, policy, variable_count=148)
    assert len(message) <= 4000, len(message)
    assert message.startswith("Loss scaling failed at step 39: persistent: the same 148 variables")
    assert (
        "block0/layer0/kernel, block0/layer1/kernel, block0/layer2/kernel and 145 more" in message
    )
    assert "  steps 10-24: nonfinite_loss, loss NaN/inf;" in message
    assert "  steps 25-39: persistent, loss finite;" in message


def test_names_in_short():
    assert telemetry.names_in_short(["a"]) == "a"
    assert telemetry.names_in_short(["a", "b", "c"]) == "a, b, c"
    assert telemetry.names_in_short(list("abcde")) == "a, b, c and 2 more"


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
