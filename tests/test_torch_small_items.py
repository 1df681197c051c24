"""Inputs torch users pass: bfloat16 parameters, dtype objects, torch LR schedulers (issue 29)."""

import numpy as np
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


# --- lossscale.torch.GradScaler: what torch's scaler accepts, checked alike --------


def _scaler(**kwargs):
    import lossscale.torch

    return lossscale.torch.GradScaler("cpu", **kwargs)


@pytest.mark.parametrize("enabled", [1, 0, True, False, np.bool_(True)])
def test_enabled_accepts_what_torch_accepts(enabled):
    ours, theirs = _scaler(enabled=enabled), torch.amp.GradScaler("cpu", enabled=enabled)
    assert ours.is_enabled() == theirs.is_enabled() == bool(enabled)
    loss = torch.tensor(3.0)
    assert float(ours.scale(loss)) == float(theirs.scale(loss))


@pytest.mark.parametrize("enabled", [2, -1, "yes", None, 1.0])
def test_enabled_refuses_other_values(enabled):
    with pytest.raises(ValueError, match=r"`enabled` must be a boolean \(or 0 or 1\)"):
        _scaler(enabled=enabled)


def test_a_tensor_init_scale_is_taken_as_torch_takes_it():
    ours = _scaler(init_scale=torch.tensor(8.0))
    theirs = torch.amp.GradScaler("cpu", init_scale=torch.tensor(8.0))
    loss = torch.tensor(3.0)
    assert float(ours.scale(loss)) == float(theirs.scale(loss)) == 24.0
    assert ours.get_scale() == theirs.get_scale() == 8.0
    with pytest.raises(
        ValueError, match=r"`init_scale` must be a positive number or a one-element"
    ):
        _scaler(init_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"init_scale"):
        _scaler(init_scale=torch.tensor(-8.0))


@pytest.mark.parametrize("bad", [-8.0, 0.0, float("nan"), float("inf")])
def test_a_tensor_new_scale_is_checked_as_a_float_is(bad):
    scaler = _scaler(init_scale=8.0)
    scaler.scale(torch.tensor(1.0))
    for new_scale in (bad, torch.tensor(bad)):
        with pytest.raises(ValueError, match=r"`new_scale` must be"):
            scaler.update(new_scale)
        assert scaler.get_scale() == 8.0  # nothing written
    scaler.update(torch.tensor(4.0))
    assert scaler.get_scale() == 4.0


def test_unscale_grads_before_scale_is_a_clear_error():
    scaler = _scaler()
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    opt = torch.optim.SGD([param], lr=0.1)
    found_inf = torch.zeros(1)
    with pytest.raises(
        RuntimeError, match=r"`GradScaler._unscale_grads_\(\)` needs the loss scale"
    ):
        scaler._unscale_grads_(opt, torch.ones(()), found_inf, False)
    assert torch.equal(param.grad, torch.ones(3))
