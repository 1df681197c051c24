"""lossscale.torch.GradScaler and float16 gradients (a model whose parameters are float16)."""

import pytest
import torch

import lossscale.torch as lt


def half_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    ).half()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, generator=g).half(), torch.randn(32, 4, generator=g).half()


def loss_of(model):
    x, y = batch()
    return (model(x) - y).float().square().mean()


@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, lt.GradScaler])
def test_by_default_float16_gradients_are_refused_as_torch_refuses_them(scaler_class):
    model = half_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_class("cpu", init_scale=2.0**10)
    scaler.scale(loss_of(model)).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler.unscale_(opt)


def test_allow_fp16_gradients_is_checked():
    with pytest.raises(ValueError, match="`allow_fp16_gradients` must be a boolean"):
        lt.GradScaler("cpu", allow_fp16_gradients="yes")


def test_a_pure_float16_model_trains_with_unscaled_checked_gradients():
    model = half_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = lt.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, allow_fp16_gradients=True)
    first = float(loss_of(model).detach())
    skipped = 0
    for step in range(12):
        opt.zero_grad()
        scaler.scale(loss_of(model) * (float("inf") if step == 4 else 1.0)).backward()
        scaled = [p.grad.clone() for p in model.parameters()]
        scale = scaler.get_scale()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.unscale_(opt)
        if step != 4:
            for p, g in zip(model.parameters(), scaled):
                # torch's kernel: times the float32 reciprocal, rounded to float16
                want = (g.float() * torch.tensor(1.0 / scale, dtype=torch.float32)).half()
                assert p.grad.dtype == torch.float16 and torch.equal(p.grad, want)
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale:
            skipped += 1
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert skipped == 1 and scaler.summary()["dynamic_scale"] == scaler.get_scale()
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert float(loss_of(model).detach()) < first


def test_a_float16_gradient_that_overflows_only_once_unscaled_skips_the_step():
    # Below a scale of 1, unscaling multiplies: 2**12 / 2**-4 = 2**16 > 65504.
    model = half_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = lt.GradScaler("cpu", init_scale=2.0**-4, allow_fp16_gradients=True)
    scaler.scale(loss_of(model)).backward()
    for p in model.parameters():
        p.grad.fill_(0.5)
    first = next(model.parameters())
    first.grad[0, 0] = 2.0**12  # finite in float16, inf once unscaled
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**-5
