"""bench/cli.py: `lossscale bench` end to end (tiny `--quick` mode), its arguments and report.

Timings are never asserted: only the report's shape.
"""

import re

import pytest

from lossscale import bench
from lossscale.bench import runner, table

ROW = re.compile(r"^\| (\S+) \| (\S+) \| (\d+\.\d{3}) \| (\d+\.\d\dx) \| (\d+\.\d\dx) \|$")


def _table_rows(out):
    lines = [line for line in out.splitlines() if line.startswith("|")]
    assert lines[0] == "| " + " | ".join(table.COLUMNS) + " |"
    assert lines[1] == "|---|---|---:|---:|---:|"
    return lines[2:]


def test_quick_run_prints_one_row_per_implementation(capsys):
    # Three subprocesses: the bandwidth floor and one per implementation.
    status = bench.main(
        [
            "--quick",
            "--workload",
            "many_small",
            "--impl",
            "lossscale-numpy",
            "--impl",
            "torch-gradscaler-foreach",
            "--repeats",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [ROW.match(line) for line in _table_rows(out)]
    assert all(rows), out
    assert [(m[1], m[2]) for m in rows] == [
        ("lossscale-numpy", "many_small"),
        ("torch-gradscaler-foreach", "many_small"),
    ]
    assert rows[1][5] == "1.00x"  # the only peer is the best peer
    assert "Bandwidth (cpu):" in out and "Median of 2 steps after 1 warm-up" in out
    assert "floor" in out and "torch 2." in out


def test_an_interleaved_run_times_a_workload_in_one_process(capsys):
    # Two subprocesses: the bandwidth floor, and both implementations together.
    argv = ["--quick", "--workload", "tiny", "--interleave", "--rounds", "2", "--repeats", "2"]
    status = bench.main(argv + ["--impl", "lossscale-numpy", "--impl", "torch-gradscaler-fused"])
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [ROW.match(line) for line in _table_rows(out)]
    assert [(m[1], m[2]) for m in rows] == [
        ("lossscale-numpy", "tiny"),
        ("torch-gradscaler-fused", "tiny"),
    ]
    assert "interleaved: side by side in one process per workload" in out
    assert out.count(" on tiny: ") == 2  # each with its two rounds' medians


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--impl", "nope"], "unknown --impl ['nope']"),
        (["--repeats", "0"], "--repeats must be an integer >= 1. Received: 0"),
        (["--warmup", "-1"], "--warmup must be an integer >= 0. Received: -1"),
        (["--warmup-seconds", "-1"], "--warmup-seconds must be a number >= 0. Received: -1.0"),
        (["--warmup-seconds", "nan"], "--warmup-seconds must be a number >= 0. Received: nan"),
        (["--retries", "-2"], "--retries must be an integer >= 0. Received: -2"),
        (["--rounds", "0"], "--rounds must be an integer >= 1. Received: 0"),
        (["--alternate-steps"], "--alternate-steps needs --interleave"),
        (["--workload", "huge"], "invalid choice: 'huge'"),
    ],
)
def test_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("choice", ["gpu_large", "gpu_many_small", "gpu_tiny", "gpu"])
def test_gpu_workload_without_cuda_fails_loudly(monkeypatch, capsys, choice):
    monkeypatch.setattr(runner, "cuda_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--workload", choice, "--quick"])
    assert exc.value.code == 2
    assert f"--workload {choice} needs a CUDA device" in capsys.readouterr().err


def test_gpu_choice_runs_every_gpu_workload_on_cuda(monkeypatch, capsys):
    monkeypatch.setattr(runner, "cuda_available", lambda: True)
    calls = []
    monkeypatch.setattr(
        runner,
        "run_job",
        lambda job, env=None, timeout=None: (
            calls.append(job)
            or (
                {"gb_per_s": 10.0, "method": "fake", "bytes": 8}
                if job["kind"] == "floor"
                else {"median_ms": 1.0}
            )
        ),
    )
    assert bench.main(["--quick", "--workload", "gpu", "--impl", "lossscale-torch"]) == 0
    assert [(j["impl"], j["workload"]) for j in calls if j["kind"] == "step"] == [
        ("lossscale-torch", "gpu_tiny"),
        ("lossscale-torch", "gpu_many_small"),
        ("lossscale-torch", "gpu_large"),
    ]
    assert [j["device"] for j in calls if j["kind"] == "floor"] == ["cuda"]


def test_all_runs_only_cpu_workloads_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(runner, "cuda_available", lambda: False)
    calls = []
    monkeypatch.setattr(
        runner,
        "run_job",
        lambda job, env=None, timeout=None: (
            calls.append((job, env))
            or (
                {"gb_per_s": 10.0, "method": "fake", "bytes": 8}
                if job["kind"] == "floor"
                else {"median_ms": 1.0}
            )
        ),
    )
    assert bench.main(["--quick", "--impl", "keras-jax", "--impl", "lossscale-numpy"]) == 0
    steps = [(job["impl"], job["workload"], env) for job, env in calls if job["kind"] == "step"]
    assert steps == [
        ("keras-jax", "tiny", {"KERAS_BACKEND": "jax"}),
        ("lossscale-numpy", "tiny", {}),
        ("keras-jax", "many_small", {"KERAS_BACKEND": "jax"}),
        ("lossscale-numpy", "many_small", {}),
        ("keras-jax", "gpt", {"KERAS_BACKEND": "jax"}),
        ("lossscale-numpy", "gpt", {}),
        ("keras-jax", "large", {"KERAS_BACKEND": "jax"}),
        ("lossscale-numpy", "large", {}),
    ]
    assert [job["device"] for job, _ in calls if job["kind"] == "floor"] == ["cpu"]
    out = capsys.readouterr().out
    assert len(_table_rows(out)) == 8
    assert "Workload tiny: 28 tensors, 2,018 float32 parameters, cpu; floor" in out


def test_failures_give_exit_status_one_and_a_row(monkeypatch, capsys):
    monkeypatch.setattr(
        runner,
        "run_job",
        lambda job, env=None, timeout=None: (
            {"gb_per_s": 10.0, "method": "fake", "bytes": 8}
            if job["kind"] == "floor"
            else {"error": "exit status 1: boom"}
        ),
    )
    assert bench.main(["--quick", "--workload", "large", "--impl", "lossscale-numpy"]) == 1
    rows = _table_rows(capsys.readouterr().out)
    assert rows == ["| lossscale-numpy | large | failed: exit status 1: boom | - | - |"]


def test_rows_disturbed_by_other_processes_are_flagged(monkeypatch, capsys):
    monkeypatch.setattr(
        runner,
        "run_job",
        lambda job, env=None, timeout=None: (
            {"gb_per_s": 10.0, "method": "fake", "bytes": 8}
            if job["kind"] == "floor"
            else {"median_ms": 2.0, "others_cores": 0.75 if job["impl"] == "keras-jax" else 0.01}
        ),
    )
    assert (
        bench.main(["--quick", "--workload", "large", "--impl", "keras-jax", "--impl", "optax-jmp"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "**Unreliable rows**: other processes kept CPUs busy (mean cores in parentheses) "
        "while these ran: keras-jax on large (0.75). Rerun on an idle machine."
    ) in out
    assert "optax-jmp on large (" not in out


def test_rounds_alternate_the_order_and_report_the_median_of_medians(monkeypatch, capsys):
    calls = []
    medians = iter([3.0, 10.0, 20.0, 5.0, 4.0, 30.0])  # numpy, jax, jax, numpy, numpy, jax

    def fake_run_job(job, env=None, timeout=None):
        if job["kind"] == "floor":
            return {"gb_per_s": 10.0, "method": "fake", "bytes": 1}
        calls.append(job["impl"])
        return {"median_ms": next(medians), "others_cores": 0.0}

    monkeypatch.setattr(runner, "run_job", fake_run_job)
    assert (
        bench.main(
            [
                "--quick",
                "--workload",
                "large",
                "--impl",
                "lossscale-numpy",
                "--impl",
                "keras-jax",
                "--rounds",
                "3",
            ]
        )
        == 0
    )
    assert calls == [
        "lossscale-numpy",
        "keras-jax",
        "keras-jax",
        "lossscale-numpy",
        "lossscale-numpy",
        "keras-jax",
    ]
    out = capsys.readouterr().out
    rows = [ROW.match(line) for line in _table_rows(out)]
    assert [(m[1], m[3]) for m in rows] == [("lossscale-numpy", "4.000"), ("keras-jax", "20.000")]
    assert "median of 3 rounds in alternating order" in out
    assert "- lossscale-numpy on large: 3.000 / 5.000 / 4.000" in out
    assert "- keras-jax on large: 10.000 / 20.000 / 30.000" in out
