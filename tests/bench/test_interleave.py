"""bench/interleave.py: implementations side by side in one process per workload."""

import argparse
import statistics

from lossscale.bench import interleave, registry, runner, worker


def _args(**overrides):
    values = dict(
        quick=True,
        repeats=2,
        warmup=0,
        warmup_seconds=0.0,
        rounds=3,
        timeout=60.0,
        retries=0,
        alternate_steps=False,
    )
    return argparse.Namespace(**{**values, **overrides})


def _spied(monkeypatch, names):
    """Registers spies of `names` that log each step; returns the log."""
    order = []
    real = registry.load()

    def spy(name):
        impl = real[name]

        def setup(workload):
            stepper = impl.setup(workload)
            step = stepper.step
            stepper.step = lambda: (order.append(name), step())[1]
            return stepper

        return impl.__class__(**{**impl.__dict__, "setup": setup})

    monkeypatch.setattr(registry, "load", lambda: {n: spy(n) for n in names})
    return order


def test_alternating_steps_takes_turns_within_each_round(monkeypatch):
    names = ["lossscale-numpy", "lossscale-torch"]
    order = _spied(monkeypatch, names)
    job = {"kind": "interleaved", "impls": names, "workload": "tiny", **vars(_args())}
    job.update(alternate_steps=True, rounds=2)
    rows = worker.run(job)["rows"]
    assert all(len(row["round_medians"]) == 2 for row in rows.values())
    a, b = names
    # one warm-up step each, then rounds of 2 steps each: A B A B, B A B A
    assert order[2:] == [a, b, a, b, b, a, b, a]


def test_the_worker_times_every_implementation_in_alternating_rounds(monkeypatch):
    names = ["lossscale-numpy", "lossscale-torch"]
    order = _spied(monkeypatch, names)
    job = {"kind": "interleaved", "impls": names, "workload": "tiny", **vars(_args())}
    result = worker.run(job)
    rows = result["rows"]
    assert set(rows) == set(names)
    for row in rows.values():
        assert len(row["round_medians"]) == 3
        assert row["median_ms"] == statistics.median(row["round_medians"])
        assert "lossscale" in row["versions"]
    # one warm-up step each, then rounds of 2 steps: A B, B A, A B
    timed = order[2:]
    runs = [timed[i] for i in range(0, len(timed), 2)]
    assert runs == ["lossscale-numpy", "lossscale-torch", "lossscale-torch"] + [
        "lossscale-numpy",
        "lossscale-numpy",
        "lossscale-torch",
    ]


def test_implementations_are_grouped_by_environment(monkeypatch):
    jobs = []

    def fake(job, env=None, timeout=None, retries=0):
        jobs.append((job["impls"], env))
        return {
            "rows": {n: {"median_ms": 1.0, "round_medians": [1.0]} for n in job["impls"]},
            "others_cores": 0.0,
        }

    monkeypatch.setattr(runner, "run_job_retrying", fake)
    available = registry.load()
    impls = [available[n] for n in ("lossscale-torch", "keras-jax", "torch-gradscaler-fused")]
    rows = interleave.run(impls, "tiny", _args())
    assert jobs == [
        (["lossscale-torch", "torch-gradscaler-fused"], {}),
        (["keras-jax"], dict(available["keras-jax"].env)),
    ]
    assert [(r["impl"], r["median_ms"], r["others_cores"]) for r in rows] == [
        ("lossscale-torch", 1.0, 0.0),
        ("torch-gradscaler-fused", 1.0, 0.0),
        ("keras-jax", 1.0, 0.0),
    ]


def test_a_failed_worker_fails_every_row_of_its_group(monkeypatch):
    monkeypatch.setattr(runner, "run_job_retrying", lambda *a, **k: {"error": "boom"})
    impls = [registry.load()["lossscale-numpy"]]
    (row,) = interleave.run(impls, "tiny", _args())
    assert row == {"impl": "lossscale-numpy", "kind": "ours", "workload": "tiny", "error": "boom"}
