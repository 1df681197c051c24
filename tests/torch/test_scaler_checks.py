"""torch/scaler_checks.py: how `GradScaler` unscales and checks an optimizer's gradients.

Where its guards differ from torch's: below a scale of 1 a finite scaled
gradient may overflow once unscaled, and the step is skipped (torch steps
with inf); the host's bound on the scale says when that extra check runs;
a `process_group` needs torch.distributed before any gradient is touched;
after a crossed fail-fast limit every step is skipped. The rest of the
scaler is compared with `torch.amp.GradScaler` in test_grad_scaler.py.
"""

import pytest
import torch

import lossscale
import lossscale.torch as lt
from tests import grad_scaler_cases as cases


def _one_step_at(cls, scale, grad, path):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=path == "fused", foreach=path != "fused")
    scaler = cls("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))
    p.grad = torch.tensor(grad)
    if path == "unscale_":
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return p.detach().clone(), scaler.get_scale()


@pytest.mark.parametrize("path", ["fused", "foreach", "unscale_"])
def test_a_gradient_that_overflows_only_when_unscaled_skips_the_step(path):
    """At a scale of 1/4 a gradient of 3e38 is finite, and 1.2e39 once unscaled."""
    theirs = _one_step_at(torch.amp.GradScaler, 0.25, [3e38, 1.0, -2.0], path)
    ours = _one_step_at(lt.GradScaler, 0.25, [3e38, 1.0, -2.0], path)
    assert not torch.isfinite(theirs[0]).all() and theirs[1] == 0.25  # torch steps with inf
    assert ours[0].tolist() == [1.0, 1.0, 1.0] and ours[1] == 0.125  # we skip and back off
    # Non-finite both before and after unscaling: one flag of 1 (a fused
    # kernel skips only on exactly 1), not the two checks' sum.
    for scale in (0.25, 4.0):
        params, new_scale = _one_step_at(lt.GradScaler, scale, [float("inf"), 1.0, 2.0], path)
        assert params.tolist() == [1.0, 1.0, 1.0] and new_scale == scale / 2


@pytest.mark.parametrize("how", ["backoffs", "new_scale", "load_state_dict"])
def test_the_guard_follows_a_scale_that_reached_below_one(how):
    """The host's bound on the scale follows backoffs and settings without reading it."""
    scaler = lt.GradScaler("cpu", init_scale=2.0)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    if how == "backoffs":  # 2 -> 1 -> 0.5
        for _ in range(2):
            scaler.scale(torch.ones(()))
            p.grad = torch.full((3,), float("nan"))
            scaler.step(opt)
            scaler.update()
    else:
        scaler.scale(torch.ones(()))
        if how == "new_scale":
            p.grad = torch.ones(3)
            scaler.step(opt)
            scaler.update(new_scale=0.5)
        else:
            scaler.load_state_dict({**scaler.state_dict(), "scale": 0.5})
    scaler.scale(torch.ones(()))
    p.grad = torch.tensor([3e38, 1.0, 2.0])
    before = p.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), before) and scaler.get_scale() == 0.25


def test_ordinary_gradients_at_a_scale_below_one_match_torch():
    """Below 1 the extra check runs; without an overflow it changes nothing."""
    for kind in ("fused", "foreach"):
        theirs, ours = (
            cls("cpu", init_scale=2.0**-3, growth_interval=4)
            for cls in (torch.amp.GradScaler, lt.GradScaler)
        )
        a, b = cases.train(theirs, kind, steps=10), cases.train(ours, kind, steps=10)
        assert a["scales"] == b["scales"] and not any(a["skipped"])
        assert cases.same_weights(a["params"], b["params"])


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_after_a_crossed_limit_finite_steps_are_skipped_too(kind):
    scaler = lt.GradScaler("cpu", init_scale=8.0, max_consecutive_skips=1)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=0.1, fused=kind == "fused", foreach=kind != "fused")
    for k, grad in enumerate((float("nan"), float("nan"), 1.0, 1.0)):
        scaler.scale(torch.ones(()))
        p.grad = torch.full((2,), grad)
        scaler.step(opt)
        if k == 0:
            scaler.update()
            continue
        with pytest.raises(lossscale.LossScaleError, match="Loss scaling failed at step 1"):
            scaler.update()
    # Caught and continued: the state stays as it was at the failure, and
    # finite steps are skipped until the state is restored.
    assert p.tolist() == [1.0, 1.0] and scaler.get_scale() == 2.0
    assert scaler.summary()["steps"] == 2
    scaler.load_state_dict(lt.GradScaler("cpu", init_scale=8.0).state_dict())
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    assert p.tolist() != [1.0, 1.0]


def test_process_group_without_torch_distributed_fails_before_unscaling():
    scaler = lt.GradScaler("cpu", init_scale=8.0, process_group=object())
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(torch.ones(()))
    p.grad = torch.full((2,), 4.0)
    message = (
        r"^`process_group` was given but torch.distributed is not initialised: call "
        r"`torch.distributed.init_process_group` before stepping. Received: "
        r"process_group=<object object at 0x[0-9a-f]+>$"
    )
    with pytest.raises(ValueError, match=message):
        scaler.step(opt)
    assert p.grad.tolist() == [4.0, 4.0]  # still scaled
