"""The demo's PNG and its smoothing."""

import numpy as np
import pytest

from lossscale.demo.plot import _centered_mean, save_plot
from lossscale.demo.training import RUNS, RunResult


def test_centered_mean_matches_a_float64_loop():
    values = np.random.default_rng(0).random(11)
    expected = [values[max(i - 2, 0) : i + 3].mean() for i in range(11)]
    np.testing.assert_allclose(_centered_mean(values, 5), expected, rtol=1e-12)


@pytest.mark.parametrize("skipped", [[], [0, 1, 7]])
def test_save_plot_writes_a_png(tmp_path, skipped):
    rng = np.random.default_rng(1)
    losses = list(np.exp(-np.linspace(0, 3, 40)) + 0.01 * rng.random(40))
    scales = [2.0 ** (20 - min(i, 2)) for i in range(40)]
    results = (
        RunResult(RUNS[0], losses=losses, scales=[None] * 40),
        RunResult(RUNS[1], losses=[2.3] * 40, scales=[None] * 40),
        RunResult(RUNS[2], losses=losses, scales=scales, skipped_steps=skipped),
        RunResult(RUNS[3], losses=losses, scales=scales[::-1], skipped_steps=skipped[:1]),
    )
    path = tmp_path / "demo.png"
    save_plot(results, str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_plot_leaves_pyplot_alone(tmp_path):
    from matplotlib import pyplot

    before = pyplot.get_fignums()
    results = tuple(RunResult(spec, losses=[1.0, 0.5], scales=[1.0, 1.0]) for spec in RUNS)
    save_plot(results, str(tmp_path / "p.png"), "t")
    assert pyplot.get_fignums() == before
