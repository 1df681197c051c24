"""Timing one optimizer step: warm up, then time each step between two synchronisations."""

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Stepper:
    """What one implementation gives the timer.

    Args:
        step: Runs one optimizer step; returns whatever `sync` waits on.
        sync: Waits until the work of a step (given its return value, or
            None) has finished. Defaults to doing nothing (synchronous code).
        prepare: Optional untimed work before each step.
    """

    step: Callable[[], Any]
    sync: Callable[[Any], Any] = lambda result: None
    prepare: Callable[[], None] | None = None


def time_steps(stepper, repeats, warmup, warmup_seconds=0.0):
    """Returns the duration in seconds of each of `repeats` steps after the warm-up.

    The warm-up runs `warmup` steps, and more until `warmup_seconds` have passed.
    """
    times = []
    warm_until = time.perf_counter() + warmup_seconds
    done = 0
    while len(times) < repeats:
        if stepper.prepare is not None:
            stepper.prepare()
        stepper.sync(None)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            start = time.perf_counter()
            stepper.sync(stepper.step())
            end = time.perf_counter()
        finally:
            if gc_was_enabled:
                gc.enable()
        done += 1
        if done > warmup and start >= warm_until:
            times.append(end - start)
    return times


def summary(times):
    """Median and spread of step times, in milliseconds."""
    ms = sorted(t * 1e3 for t in times)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "steps": len(ms)}
