"""torch/scale_bound.py: the host's lower bound of GradScaler's scale stays below the scale."""

import numpy as np
import pytest
import torch

import lossscale.torch as lt
from lossscale.mixed_precision.loss_scale import MIN_SCALE, LossScalePolicy
from lossscale.torch import scale_bound


def test_one_update_lowers_the_bound_by_a_backoff_and_float32_rounding():
    policy = LossScalePolicy(2.0**16)
    assert scale_bound.after_update(2.0**16, policy) == 2.0**15 * scale_bound.ROUNDING


def test_max_scale_caps_the_bound():
    policy = LossScalePolicy(2.0**10, max_scale=2.0**10)
    assert scale_bound.after_update(2.0**16, policy) == 2.0**10


def test_a_plain_policy_at_its_floor_stays_there_and_another_goes_under():
    plain = LossScalePolicy(2.0**16)
    assert plain.is_plain
    assert scale_bound.after_update(MIN_SCALE, plain) == MIN_SCALE
    assert scale_bound.after_update(MIN_SCALE / 4, plain) < MIN_SCALE / 4
    capped = LossScalePolicy(2.0**16, max_scale=2.0**20)
    assert not capped.is_plain
    assert scale_bound.after_update(MIN_SCALE, capped) < MIN_SCALE


@pytest.mark.parametrize("backoff_factor", [0.5, 0.3, 0.9])
def test_the_bound_stays_at_or_below_the_scale_through_overflows(backoff_factor):
    """A GradScaler whose gradients overflow at random steps, factors that round in float32."""
    rng = np.random.default_rng(int(backoff_factor * 10))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = lt.GradScaler(
        "cpu", init_scale=2.0**20, backoff_factor=backoff_factor, growth_interval=3
    )
    for _ in range(60):
        x = torch.ones(2, 4)
        if rng.random() < 0.5:
            x[0, 0] = np.inf
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler._scale_bound <= float(scaler.get_scale())
