"""The demo's float16-range heatmap: the matrices it draws, and the PNG."""

import numpy as np
import pytest

from lossscale.demo.heatmap import SHARES, range_matrix, save_heatmap
from lossscale.demo.training import RUNS, RunResult

LAYERS = ("w1", "b1", "w2", "b2")


def _measured(rng, steps, every):
    """Entries shaped as `RunResult.float16_range`, seeded; one overflow at the 2nd step."""
    entries = []
    for k in range(steps):
        shares = rng.dirichlet(np.ones(4), size=len(LAYERS))
        entry = {
            name: {
                "zero": float(s[0]),
                "subnormal": float(s[1]),
                "near_max": 0.0 if k % 2 else float(s[2]),
                "max_abs": float(2.0 ** rng.uniform(-12, 15)),
            }
            for name, s in zip(LAYERS, shares)
        }
        if k == 1:
            entry["w2"]["max_abs"] = float("inf")
        entries.append({"step": k * every, "range": entry})
    return entries


def _runs(rng, steps=30, every=50):
    return [
        RunResult(spec, float16_range=_measured(rng, steps, every))
        for spec in RUNS
        if spec.loss_scaling
    ]


def test_range_matrix_is_layers_by_measured_steps():
    result = _runs(np.random.default_rng(0), steps=7, every=3)[0]
    for key in [k for k, _ in SHARES] + ["max_abs"]:
        layers, steps, matrix = range_matrix(result, key)
        assert layers == list(LAYERS) and steps == [0, 3, 6, 9, 12, 15, 18]
        assert matrix.shape == (4, 7) and matrix.dtype == np.float64
        expected = [[e["range"][n][key] for e in result.float16_range] for n in LAYERS]
        np.testing.assert_array_equal(matrix, expected)
    assert range_matrix(result, "max_abs")[2][2, 1] == np.inf


def test_range_matrix_refuses_a_run_without_measurements():
    with pytest.raises(ValueError, match=r"Received: the run 'float32' with float16_range=\[\]"):
        range_matrix(RunResult(RUNS[0]), "zero")


@pytest.mark.parametrize("steps", [1, 30])
def test_save_heatmap_writes_a_png(tmp_path, steps):
    path = tmp_path / "demo_float16_range.png"
    save_heatmap(_runs(np.random.default_rng(1), steps=steps), str(path), "title", 50)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 20_000


def test_save_heatmap_leaves_pyplot_alone(tmp_path):
    from matplotlib import pyplot

    before = pyplot.get_fignums()
    save_heatmap(_runs(np.random.default_rng(2), steps=3), str(tmp_path / "h.png"), "t", 10)
    assert pyplot.get_fignums() == before
