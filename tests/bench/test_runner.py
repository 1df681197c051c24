"""bench/runner.py: each job in its own subprocess, what other processes cost it, retries."""

import os
import pathlib

import lossscale
from lossscale.bench import runner


def test_runner_reports_a_failing_worker():
    result = runner.run_job(
        {
            "kind": "step",
            "impl": "no-such-impl",
            "workload": "large",
            "quick": True,
            "repeats": 1,
            "warmup": 0,
            "warmup_seconds": 0.0,
        }
    )
    assert set(result) == {"error"}
    assert "KeyError" in result["error"] and "no-such-impl" in result["error"]


def test_others_cores_is_busy_time_minus_the_jobs_own():
    # 4 s of wall time; the machine was busy 6 CPU-seconds, 5 of them the job's.
    assert runner._others_cores((10.0, 100.0, 1.0), (14.0, 106.0, 6.0)) == 0.25
    assert runner._others_cores((10.0, 100.0, 1.0), (14.0, 104.0, 6.0)) == 0.0
    assert runner._others_cores(None, (14.0, 106.0, 6.0)) is None
    sample = runner._cpu_seconds()
    assert sample is None or len(sample) == 3


def test_disturbed_runs_are_retried_after_waiting_for_idle(monkeypatch):
    results = iter(
        [
            {"median_ms": 5.0, "others_cores": 0.9},
            {"median_ms": 3.0, "others_cores": 0.3},
            {"median_ms": 4.0, "others_cores": 0.5},
        ]
    )
    waits = []
    monkeypatch.setattr(runner, "wait_for_idle", lambda: waits.append(1) or True)
    monkeypatch.setattr(runner, "run_job", lambda job, env=None, timeout=None: next(results))
    assert runner.run_job_retrying({}, retries=2) == {"median_ms": 3.0, "others_cores": 0.3}
    assert len(waits) == 3
    # An undisturbed first run ends it; no retries means no waiting.
    monkeypatch.setattr(runner, "run_job", lambda job, env=None, timeout=None: {"others_cores": 0})
    waits.clear()
    assert runner.run_job_retrying({}, retries=0) == {"others_cores": 0} and waits == []
    assert runner.run_job_retrying({}, retries=5) == {"others_cores": 0} and waits == [1]


def test_wait_for_idle_returns_once_the_cpus_are_quiet(monkeypatch):
    samples = iter([(0.0, 0.0, 0), (3.0, 5.0, 0), (3.0, 5.0, 0), (6.0, 5.1, 0)])
    monkeypatch.setattr(runner, "_cpu_seconds", lambda: next(samples))
    monkeypatch.setattr(runner.time, "sleep", lambda s: None)
    assert runner.wait_for_idle() is True
    monkeypatch.setattr(runner, "_cpu_seconds", lambda: None)
    assert runner.wait_for_idle() is False


def test_a_job_runs_in_a_fresh_interpreter_and_returns_its_result():
    job = {
        "kind": "step",
        "impl": "lossscale-numpy",
        "workload": "large",
        "quick": True,
        "repeats": 2,
        "warmup": 0,
        "warmup_seconds": 0.0,
    }
    result = runner.run_job(job, timeout=120)
    assert result["steps"] == 2 and result["median_ms"] > 0
    assert set(result["versions"]) == {"lossscale", "numpy"}
    assert result["others_cores"] >= 0  # Linux: /proc/stat is read


def test_a_job_past_its_timeout_is_an_error():
    job = {"kind": "floor", "device": "cpu", "quick": True}
    assert runner.run_job(job, timeout=0.001) == {"error": "timed out after 0.001 s"}


def test_the_worker_imports_this_lossscale(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = runner._environment({"KERAS_BACKEND": "jax"})
    source_root = pathlib.Path(lossscale.__file__).resolve().parents[1]
    assert env["PYTHONPATH"].split(os.pathsep) == [str(source_root), "/elsewhere"]
    assert env["KERAS_BACKEND"] == "jax"
    monkeypatch.delenv("PYTHONPATH")
    assert runner._environment({})["PYTHONPATH"] == str(source_root)
