"""Benchmark workloads: sizes as documented; random, never-zero, reproducible data."""

import numpy as np
import pytest

from lossscale.bench import workloads


@pytest.mark.parametrize(
    "name,tensors,low,high,device",
    [
        ("many_small", 400, 0.9e6, 1.1e6, "cpu"),
        ("large", 16, 16e6, 17e6, "cpu"),
        ("gpu_many_small", 400, 0.9e6, 1.1e6, "cuda"),
        ("gpu_large", 64, 250e6, 270e6, "cuda"),
    ],
)
def test_sizes(name, tensors, low, high, device):
    w = workloads.get(name)
    assert (w.name, len(w.shapes), w.device) == (name, tensors, device)
    assert low <= w.size <= high
    assert w.describe() == f"{tensors} tensors, {w.size:,} float32 parameters, {device}"


def test_many_small_has_mixed_shapes():
    shapes = workloads.get("many_small").shapes
    assert {len(s) for s in shapes} == {1, 2, 4}
    assert len(set(shapes)) > 30


@pytest.mark.parametrize("name", workloads.NAMES)
def test_quick_versions_are_tiny(name):
    quick = workloads.get(name, quick=True)
    assert quick.name == name and quick.size < 200_000
    assert quick.device == workloads.get(name).device


def test_arrays_are_float32_random_never_zero_and_reproducible():
    w = workloads.get("many_small", quick=True)
    params, grads = workloads.arrays(w, loss_scaled=False)
    again, scaled = workloads.arrays(w)
    assert [p.shape for p in params] == list(w.shapes) == [g.shape for g in grads]
    for p, g, p2 in zip(params, grads, again):
        assert p.dtype == g.dtype == np.float32
        np.testing.assert_array_equal(p, p2)
        assert np.all(np.abs(p) >= 0.5) and np.all(np.abs(p) <= 1.5)
        assert np.all(np.abs(g) >= 0.5e-3) and np.all(np.abs(g) <= 1.5e-3)
    flat = np.concatenate([p.ravel() for p in params])
    assert 0.4 < np.mean(flat > 0) < 0.6  # random signs
    for g, s in zip(grads, scaled):
        np.testing.assert_array_equal(s, g * np.float32(workloads.LOSS_SCALE))


def test_unknown_workload():
    with pytest.raises(
        ValueError,
        match=r"`workload` must be one of \('many_small', 'large', "
        r"'gpu_many_small', 'gpu_large'\). Received: "
        r"workload='huge'",
    ):
        workloads.get("huge")


def test_gpu_many_small_is_many_small_on_cuda():
    cpu, gpu = workloads.get("many_small"), workloads.get("gpu_many_small")
    assert gpu.shapes == cpu.shapes and gpu.device == "cuda"
