"""torch/fused_sgd.py: which optimizer step is torch's fused SGD's first, unskippable one."""

import pytest
import torch

from lossscale.torch import fused_sgd


def _params(grads=(True, True)):
    params = [torch.nn.Parameter(torch.ones(9)) for _ in grads]
    for p, has_grad in zip(params, grads):
        p.grad = torch.full((9,), 0.5) if has_grad else None
    return params


@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_with_momentum_before_its_first_applied_step(nesterov):
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=nesterov, fused=True)
    assert fused_sgd.makes_momentum_buffers(opt)
    opt.step()
    assert not fused_sgd.makes_momentum_buffers(opt)


def test_the_first_parameter_with_a_gradient_tells():
    frozen_first = _params(grads=(False, True))
    opt = torch.optim.SGD(frozen_first, lr=0.1, momentum=0.9, fused=True)
    assert fused_sgd.makes_momentum_buffers(opt)
    opt.step()  # torch makes the buffer of the parameter with a gradient only
    assert "momentum_buffer" not in opt.state[frozen_first[0]]
    assert not fused_sgd.makes_momentum_buffers(opt)
    no_grads = _params(grads=(False, False))
    assert not fused_sgd.makes_momentum_buffers(
        torch.optim.SGD(no_grads, lr=0.1, momentum=0.9, fused=True)
    )


def test_each_fused_group_with_momentum_is_asked():
    first, second = _params(), _params()
    opt = torch.optim.SGD(
        [{"params": first}, {"params": second, "momentum": 0.5}], lr=0.1, momentum=0.9, fused=True
    )
    opt.step()
    opt.add_param_group({"params": _params(), "momentum": 0.9})
    assert fused_sgd.makes_momentum_buffers(opt)
    plain = torch.optim.SGD(
        [{"params": _params()}, {"params": _params(), "momentum": 0.9}], lr=0.1, fused=True
    )
    assert fused_sgd.makes_momentum_buffers(plain)  # the second group has momentum


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
    ],
    ids=["sgd fused", "sgd momentum foreach", "sgd momentum", "adam fused", "adagrad fused"],
)
def test_no_other_optimizer(make):
    assert not fused_sgd.makes_momentum_buffers(make(_params()))


def test_not_a_torch_optimizer():
    assert not fused_sgd.makes_momentum_buffers(object())
