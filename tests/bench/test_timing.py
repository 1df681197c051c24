"""Step timing: warm-up untimed, prepare before and sync around every step."""

import time

from lossscale.bench import timing


def test_time_steps_order_and_counts():
    events = []
    stepper = timing.Stepper(
        step=lambda: events.append("step") or "result",
        sync=lambda r: events.append(("sync", r)),
        prepare=lambda: events.append("prepare"),
    )
    times = timing.time_steps(stepper, repeats=3, warmup=2)
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert events == ["prepare", ("sync", None), "step", ("sync", "result")] * 5


def test_warm_up_lasts_at_least_warmup_seconds():
    steps = []
    stepper = timing.Stepper(step=lambda: steps.append(time.perf_counter()) or time.sleep(0.01))
    times = timing.time_steps(stepper, repeats=3, warmup=1, warmup_seconds=0.1)
    assert len(times) == 3 and all(t >= 0.01 for t in times)
    # the timed steps are the last three, started 0.1 s or more after the first
    assert len(steps) >= 3 + 6 and steps[-3] - steps[0] >= 0.1


def test_summary_in_milliseconds():
    assert timing.summary([0.003, 0.001, 0.002, 0.010]) == {
        "median_ms": 2.5,
        "min_ms": 1.0,
        "max_ms": 10.0,
        "steps": 4,
    }
