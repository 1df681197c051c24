"""scale_update: torch's `_amp_update_scale_` with the floor equals `next_loss_scale`'s selects."""

import numpy as np
import pytest
import torch

import lossscale.backends.torch as torch_backend
from lossscale.backends.torch import kernels as torch_kernels
from lossscale.backends.torch import scale_update
from lossscale.mixed_precision.loss_scale import MIN_SCALE
from tests.torch_cases import count_ops, no_host_reads

TINY = float(np.finfo(np.float32).tiny)


@pytest.mark.parametrize(
    "initial,growth,backoff,steps",
    [
        (2.0**15, 2.0, 0.5, 3),
        (1.0, 4.0, 0.25, 2),
        (2.0**126, 2.0, 0.5, 1),  # growth past float32's range is not taken
        (4 * float(np.finfo(np.float32).tiny), 2.0, 0.5, 4),  # backoff stops at the floor
        (1e-40, 2.0, 0.5, 3),  # a scale below the floor only moves up to it on overflow
    ],
)
def test_fused_scale_update_equals_the_generic_selects(
    monkeypatch, initial, growth, backoff, steps
):
    from lossscale.mixed_precision import LossScalePolicy, LossScaleState, next_loss_scale

    policy = LossScalePolicy(2.0**15, steps, growth_factor=growth, backoff_factor=backoff)
    assert policy.is_plain
    pattern = np.random.default_rng(7).random(60) < 0.8
    calls = []

    def run(kernel, counter_dtype):
        monkeypatch.setattr(torch_backend, "fused_scale_update", lambda: kernel)
        state = LossScaleState(
            torch.tensor(initial, dtype=torch.float32), torch.tensor(0, dtype=counter_dtype)
        )
        trail = []
        for finite in pattern:
            state = next_loss_scale(torch_backend, state, torch.tensor(bool(finite)), policy)
            trail.append(
                (state.scale.item(), state.counter.item(), state.scale.dtype, state.counter.dtype)
            )
        return trail

    def counting(*args, **kwargs):
        calls.append(1)
        return scale_update.update_scale(*args, **kwargs)

    generic = run(None, torch.int32)
    assert run(counting, torch.int32) == generic and len(calls) == len(pattern)
    assert [t[:2] for t in run(counting, torch.int64)] == [t[:2] for t in generic]
    assert run(counting, torch.int64)[-1][3] == torch.int64  # the state keeps its dtypes


def test_fused_scale_update_reads_nothing_on_the_host():
    scale, counter = torch.tensor(8.0), torch.tensor(1, dtype=torch.int32)
    with no_host_reads():
        new_scale, new_counter = torch_kernels.fused_scale_update()(
            scale, counter, torch.tensor(True), 2, 2.0, 0.5, 1e-38
        )
    assert (float(new_scale), int(new_counter)) == (16.0, 0)
    assert (float(scale), int(counter)) == (8.0, 1)  # inputs untouched


@pytest.mark.parametrize(
    "initial, at_least, floor_ops",
    [
        (2.0**-120, 2.0**-120, []),  # a backoff cannot reach the floor: no operation
        (2.0**-126 * 1.5, 2.0**-126 * 1.5, ["aten.clamp_min_.default"]),  # at or above it
        (2.0**-125, 2.0**-125, ["aten.clamp_min_.default"]),  # halved exactly onto it
        (2.0**-125, 0.0, ["aten.mul.Tensor", "aten.clamp_min_.Tensor"]),  # no bound known
        (1e-40, 1e-40, ["aten.mul.Tensor", "aten.clamp_min_.Tensor"]),  # below the floor
    ],
)
def test_scale_at_least_leaves_out_only_floors_that_cannot_bind(initial, at_least, floor_ops):
    """Each tier against the bound-free update: the same scale and counter, bit for bit."""
    assert MIN_SCALE == TINY
    pattern = [False, True, False, False, True, True, False]
    for finite in pattern:
        results = []
        for bound in (0.0, at_least):
            scale = torch.tensor(initial, dtype=torch.float32)
            counter = torch.tensor(1, dtype=torch.int32)
            skip = torch.tensor(0.0 if finite else 1.0)
            with count_ops() as seen:
                scale_update.update_scale(
                    scale,
                    counter,
                    None,
                    2,
                    2.0,
                    0.5,
                    TINY,
                    skip=skip,
                    in_place=True,
                    scale_at_least=bound,
                )
            results.append((scale.item(), counter.item()))
        assert results[0] == results[1], (finite, results)
        assert seen == ["aten._amp_update_scale_.default", *floor_ops]
        if not finite:
            assert results[1][0] == max(np.float32(initial) * np.float32(0.5), TINY) or (
                initial < TINY and results[1][0] == TINY
            )
