"""benchmarks/gpu.py: `lossscale bench` on the GPU workloads, and its refusal without CUDA."""

from lossscale import bench


def _load_script(name):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_script_fails_loudly_without_cuda(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _load_script("gpu").main([]) == 2
    assert "benchmarks/gpu.py: error: CUDA is not available" in capsys.readouterr().err


def test_gpu_script_runs_the_gpu_workloads_with_its_defaults(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(argv) or 0)
    assert _load_script("gpu").main(["--repeats", "50"]) == 0
    assert seen == [
        [
            "--workload",
            "gpu",
            "--repeats",
            "20",
            "--warmup",
            "4",
            "--timeout",
            "150",
            "--repeats",
            "50",
        ]
    ]
