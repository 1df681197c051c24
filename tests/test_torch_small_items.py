"""Inputs torch users pass: bfloat16 parameters, dtype objects, torch LR schedulers (issue 29).

What `lossscale.torch.GradScaler` accepts as torch's scaler does is in
tests/torch/test_grad_scaler.py.
"""

import pytest
import torch

import lossscale as ls


def bits(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "RMSprop", "Lion"])
def test_bfloat16_parameters_train_and_skip(name):
    generator = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=generator) for s in [(5,), (4, 3), (300,)]]
    params = [torch.nn.Parameter(x.to(torch.bfloat16)) for x in start]
    opt = ls.LossScaleOptimizer(getattr(ls.optimizers, name)(learning_rate=0.01), initial_scale=8.0)
    opt.scale_loss(1.0)
    grads = [torch.randn(s, generator=generator) for s in [(5,), (4, 3), (300,)]]
    opt.apply([(g * 8).to(torch.bfloat16) for g in grads], params)
    assert all(p.dtype == torch.bfloat16 for p in params)
    slots = [v.value for v in opt.inner_optimizer.variables if v.value.shape == (300,)]
    assert all(s.dtype == torch.bfloat16 for s in slots) and (slots or name == "SGD")
    moved = [p.detach().clone() for p in params]
    # Applied: the rule's state moved (Adam's parameters may not: 1 - beta_2
    # is 0 in bfloat16, as in Keras, whose rule casts beta_2 to the
    # variable's dtype too).
    assert int(opt.inner_optimizer.iterations) == 1
    changed = [not torch.equal(m, x.to(torch.bfloat16)) for m, x in zip(moved, start)]
    assert all(changed) or name in ("Adam", "AdamW")
    poisoned = [(g * 8).to(torch.bfloat16) for g in grads]
    poisoned[1][0, 0] = float("inf")
    state = [v.value.clone() for v in opt.variables]
    opt.apply(poisoned, params)  # skipped: nothing of the model or the rule changes
    for p, m in zip(params, moved):
        assert torch.equal(bits(p.detach()), bits(m))
    for v, old in zip(opt.inner_optimizer.variables, state[len(opt._variables) :]):
        assert torch.equal(v.value, old)
    assert float(opt.dynamic_scale) == 4.0


def test_a_framework_dtype_object_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`dtype` must be a dtype name .* dtype=torch.float16"):
        ls.Variable("zeros", shape=(3,), dtype=torch.float16)
    with pytest.raises(ValueError, match=r"`dtype` must be a dtype name .* dtype=torch.float16"):
        ls.Variable(torch.zeros(3), dtype=torch.float16)
    assert ls.Variable(torch.zeros(3), dtype="float16").value.dtype == torch.float16


def test_a_torch_lr_scheduler_on_a_loss_scale_optimizer_points_at_the_torch_optimizer():
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam())
    with pytest.raises(AttributeError, match=r"lossscale\.torch\.Optimizer"):
        torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    assert not hasattr(opt, "param_groups")
