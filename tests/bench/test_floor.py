"""The memory floor: 32 bytes per parameter over measured copy bandwidth."""

import importlib.util

import pytest

from lossscale.bench import floor


def test_floor_ms():
    assert floor.BYTES_PER_PARAMETER == 32
    # 1e9 parameters * 32 bytes at 32 GB/s = 1 s.
    assert floor.floor_ms(10**9, 32.0) == pytest.approx(1000.0)


@pytest.mark.parametrize("measure", ["numpy", "default"])
def test_quick_measurement_returns_a_positive_rate(measure):
    result = floor._measure_numpy(quick=True) if measure == "numpy" else floor.measure(quick=True)
    assert result["gb_per_s"] > 0 and result["bytes"] == 4 * 2**20
    expected = (
        "torch copy_"
        if measure == "default" and importlib.util.find_spec("torch")
        else ("numpy copyto")
    )
    assert result["method"].startswith(expected) and "threads" in result["method"]


def test_the_torch_measurement_leaves_torchs_thread_count_as_it_was():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        floor._measure_torch_cpu(torch, quick=True)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_bad_device():
    with pytest.raises(
        ValueError, match="`device` must be 'cpu' or 'cuda'. Received: device='tpu'"
    ):
        floor.measure("tpu")
