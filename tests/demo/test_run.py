"""demo/run.py: `run_demo` end to end, through `lossscale demo --quick` as the README runs it.

Also the check that names every missing package before anything runs.
"""

import doctest
import json
import re
import subprocess
import sys

import pytest

import lossscale.demo
from lossscale.demo import run as demo_run
from lossscale.demo.config import DemoConfig
from lossscale.demo.report import COLUMNS

LABELS = (
    "float32",
    "float16, no loss scaling",
    "float16 + LossScaleOptimizer",
    "float16 + LossScaleOptimizer, statistics",
)


# One test process runs this module's tests, so `lossscale demo --quick`
# (seconds) runs once, not once in each.
pytestmark = pytest.mark.xdist_group("demo_quick_run")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(
        [sys.executable, "-m", "lossscale", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    with open(out / "results.json", encoding="utf-8") as f:
        results = json.load(f)
    return proc, out, results


def test_prints_the_table(quick_run):
    proc, _, results = quick_run
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| run"))
    assert [c.strip() for c in header.strip("|").split("|")] == list(COLUMNS)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| float")]
    assert [r.split("|")[1].strip() for r in rows] == list(LABELS)
    assert results["table"] in proc.stdout
    assert results["summary"] in proc.stdout


def test_writes_the_pngs_and_prints_their_paths(quick_run):
    proc, out, _ = quick_run
    for name, line in (("demo.png", "Plot"), ("demo_float16_range.png", "Float16 range")):
        png = out / name
        assert f"{line}: {png}" in proc.stdout
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 20_000


def test_saves_each_layers_float16_range_at_the_measured_steps(quick_run):
    _, _, results = quick_run
    every = results["config"]["diagnostics_every"]
    assert every == 50
    for run in results["runs"]:
        if not run["spec"]["loss_scaling"]:
            assert run["float16_range"] == []
            continue
        # 300 steps, one measurement in 50: the heatmap's 6 columns.
        assert [e["step"] for e in run["float16_range"]] == list(range(0, 300, every))
        for entry in run["float16_range"]:
            assert list(entry["range"]) == ["w1", "b1", "w2", "b2"]
            for measured in entry["range"].values():
                assert set(measured) == {"zero", "subnormal", "near_max", "max_abs"}
    policies = [r["spec"]["growth_policy"] for r in results["runs"] if r["spec"]["loss_scaling"]]
    assert policies == ["fixed", "statistics"]


def test_shows_a_progress_bar_per_run(quick_run):
    proc, _, _ = quick_run
    for label in LABELS:
        assert label in proc.stderr
    # The bar refreshes on its own clock: a fast run may show only the final scale.
    assert "300/300" in proc.stderr and re.search(r"scale=[0-9.e+]+", proc.stderr)


def test_loss_scaling_matches_float32_and_unscaled_float16_loses_gradients(quick_run):
    _, _, results = quick_run
    reference, unscaled, scaled, statistics = results["runs"]
    assert [r["spec"]["label"] for r in results["runs"]] == list(LABELS)
    assert abs(scaled["test_accuracy"] - reference["test_accuracy"]) <= 0.02
    assert reference["flush_share"] is None and reference["nonzero"] == 0
    assert unscaled["flushed"] > 0 and unscaled["flush_share"] > 0.05
    assert scaled["flush_share"] < unscaled["flush_share"] / 10
    assert scaled["gradient_error"] < 0.05 < unscaled["gradient_error"]
    assert unscaled["test_accuracy"] < reference["test_accuracy"] - 0.2
    assert abs(statistics["test_accuracy"] - reference["test_accuracy"]) <= 0.02
    assert len(statistics["skipped_steps"]) <= len(scaled["skipped_steps"])
    assert statistics["flush_share"] < unscaled["flush_share"] / 10
    assert all(len(r["losses"]) == 300 for r in results["runs"])
    assert results["config"]["steps"] == 300


def test_docstring_example():
    result = doctest.testmod(lossscale.demo, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "backend, missing, message",
    [
        (
            "numpy",
            {"tqdm"},
            "`lossscale demo --backend numpy` needs tqdm, which is not installed. "
            "Install the demo extra: pip install 'lossscale[demo]'",
        ),
        (
            "tensorflow",
            {"matplotlib", "tensorflow"},
            "`lossscale demo --backend tensorflow` needs matplotlib, tensorflow-cpu, which are "
            "not installed. Install the demo extra: pip install 'lossscale[demo]' tensorflow-cpu",
        ),
        (
            "jax",
            {"sklearn", "jax"},
            "`lossscale demo --backend jax` needs scikit-learn, jax, which are not installed. "
            "Install the demo extra: pip install 'lossscale[demo]' jax",
        ),
    ],
)
def test_a_missing_package_is_named_before_anything_runs(
    monkeypatch, tmp_path, backend, missing, message
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    out = tmp_path / "out"
    config = DemoConfig(steps=5, backend=backend, out=str(out), progress=False)
    with pytest.raises(demo_run.MissingDependencyError) as info:
        demo_run.run_demo(config)
    assert str(info.value) == message
    assert not out.exists()


def test_every_backend_has_what_it_needs_here():
    for backend in ("torch", "numpy", "jax", "tensorflow"):
        demo_run.check_dependencies(backend)
