"""bench/worker.py: the subprocess side of the runner, one job and one JSON result line."""

import json

from lossscale.bench import runner, worker


def test_worker_runs_a_step_job_in_process():
    result = worker.run(
        {
            "kind": "step",
            "impl": "lossscale-numpy",
            "workload": "large",
            "quick": True,
            "repeats": 3,
            "warmup": 1,
            "warmup_seconds": 0.0,
        }
    )
    assert result["steps"] == 3
    assert 0 < result["min_ms"] <= result["median_ms"] <= result["max_ms"]
    assert set(result["versions"]) == {"lossscale", "numpy"}


def test_main_prints_the_result_as_json_on_the_last_line(capsys):
    job = {"kind": "floor", "device": "cpu", "quick": True}
    assert worker.main([json.dumps(job)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(runner.RESULT_PREFIX)
    result = json.loads(last[len(runner.RESULT_PREFIX) :])
    assert result["gb_per_s"] > 0 and result["bytes"] > 0


def test_an_implementation_unavailable_here_is_skipped_with_its_reason(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    job = {
        "kind": "step",
        "impl": "lossscale-torch",
        "workload": "gpu_large",
        "quick": True,
        "repeats": 1,
        "warmup": 0,
        "warmup_seconds": 0.0,
    }
    assert worker.run(job) == {"skipped": "torch sees no CUDA device"}


def test_an_interleaved_job_times_its_implementations_side_by_side():
    job = {
        "kind": "interleaved",
        "impls": ["lossscale-numpy", "torch-gradscaler-foreach"],
        "workload": "tiny",
        "quick": True,
        "repeats": 2,
        "warmup": 0,
        "warmup_seconds": 0.0,
        "rounds": 2,
    }
    rows = worker.run(job)["rows"]
    assert list(rows) == job["impls"]
    for row in rows.values():
        assert len(row["round_medians"]) == 2 and row["median_ms"] > 0
    assert set(rows["torch-gradscaler-foreach"]["versions"]) == {"lossscale", "numpy", "torch"}
