"""Benchmark workloads: sizes as documented; random, never-zero, reproducible data."""

import numpy as np
import pytest

from lossscale.bench import workloads


@pytest.mark.parametrize(
    "name,tensors,low,high,device",
    [
        ("tiny", 28, 117_002, 117_002, "cpu"),
        ("many_small", 400, 0.9e6, 1.1e6, "cpu"),
        ("gpt", 29, 986_624, 986_624, "cpu"),
        ("large", 16, 16e6, 17e6, "cpu"),
        ("gpu_tiny", 28, 117_002, 117_002, "cuda"),
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
        match=r"`workload` must be one of \('tiny', 'many_small', 'gpt', 'large', "
        r"'gpu_tiny', 'gpu_many_small', 'gpu_large'\). Received: "
        r"workload='huge'",
    ):
        workloads.get("huge")


@pytest.mark.parametrize("name", ["tiny", "many_small"])
@pytest.mark.parametrize("quick", [False, True])
def test_gpu_versions_are_the_cpu_ones_on_cuda(name, quick):
    cpu, gpu = workloads.get(name, quick), workloads.get(f"gpu_{name}", quick)
    assert gpu.shapes == cpu.shapes and gpu.device == "cuda"


def test_tiny_is_a_small_transformers_parameters():
    import torch

    layer = torch.nn.TransformerEncoderLayer(64, 4, 256)
    shapes = [tuple(p.shape) for p in layer.parameters()]
    embedding = torch.nn.Embedding(128, 64).weight.shape
    head = torch.nn.Linear(64, 10)
    expected = (
        [tuple(embedding)] * 2  # tokens, positions
        + shapes * 2
        + [tuple(head.weight.shape), tuple(head.bias.shape)]
    )
    assert list(workloads.get("tiny").shapes) == expected
    # The quick version keeps the layout, every dimension an eighth (rounded up).
    quick = workloads.get("tiny", quick=True).shapes
    assert [len(s) for s in quick] == [len(s) for s in expected]
    assert quick[:3] == ((16, 8), (16, 8), (24, 8)) and quick[-2:] == ((2, 8), (2,))


def test_gpt_is_a_small_gpts_parameters():
    import torch

    d = 128

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = torch.nn.LayerNorm(d)
            self.c_attn = torch.nn.Linear(d, 3 * d)
            self.attn_proj = torch.nn.Linear(d, d)
            self.ln_2 = torch.nn.LayerNorm(d)
            self.c_fc = torch.nn.Linear(d, 4 * d)
            self.mlp_proj = torch.nn.Linear(4 * d, d)

    gpt = torch.nn.ModuleList(
        [torch.nn.Embedding(2048, d), torch.nn.Embedding(512, d), Block(), Block()]
        + [torch.nn.LayerNorm(d), torch.nn.Linear(d, 2048, bias=False)]
    )
    expected = [tuple(p.shape) for p in gpt.parameters()]
    assert list(workloads.get("gpt").shapes) == expected
    assert len(expected) == 29 and sum(p.numel() for p in gpt.parameters()) == 986_624
    quick = workloads.get("gpt", quick=True).shapes
    assert [len(s) for s in quick] == [len(s) for s in expected]
    assert quick[0] == (256, 16)
