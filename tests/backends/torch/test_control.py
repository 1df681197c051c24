"""backends/torch/control.py: branches on device values, undone where not taken."""

import dataclasses

import numpy as np
import pytest
import torch

import lossscale as ls
import lossscale.backends.torch as torch_backend
from lossscale.backends.torch import control
from lossscale.optimizers import SGD, Adam, RMSprop
from tests.torch_cases import SHAPES, apply, inject, random_grads


def variable(values, dtype=torch.float32):
    return ls.Variable(torch.tensor(values, dtype=dtype))


@pytest.mark.parametrize("taken", [True, False])
def test_cond_on_tensor_runs_both_branches_and_keeps_the_one_taken(taken):
    x, y = variable([1.0, 2.0]), variable([5.0])
    seen = []

    def true_fn():
        seen.append("true")
        x.assign(torch.tensor([10.0, 20.0]))

    def false_fn():
        seen.append("false")
        x.assign_add(100.0)
        y.assign(torch.tensor([np.nan]))

    control.cond(torch.tensor(taken), true_fn, false_fn, [x, y])
    assert seen == ["true", "false"]
    assert x.value.tolist() == ([10.0, 20.0] if taken else [101.0, 102.0])
    assert (y.value.tolist() == [5.0]) is taken


@pytest.mark.parametrize("pred", [True, False, np.bool_(True), np.bool_(False)])
def test_cond_on_host_boolean_is_a_plain_if(pred):
    calls = []
    control.cond(pred, lambda: calls.append("true"), lambda: calls.append("false"), [])
    assert calls == (["true"] if pred else ["false"])
    control.cond(pred, lambda: calls.append("again"), None, [])  # no false branch
    assert calls[1:] == (["again"] if pred else [])


@pytest.mark.parametrize("outer", [True, False])
@pytest.mark.parametrize("inner", [True, False])
def test_nested_conds(outer, inner):
    x = variable([0.0])

    def outer_true():
        control.cond(torch.tensor(inner), lambda: x.assign_add(1.0), lambda: x.assign_add(2.0), [x])

    control.cond(torch.tensor(outer), outer_true, lambda: x.assign_add(4.0), [x])
    assert x.value.tolist() == [(1.0 if inner else 2.0) if outer else 4.0]


def test_the_branch_not_taken_leaves_every_bit():
    x = variable([1.0, -0.0, 3.0])
    counter = variable(3, dtype=torch.int32)
    before = x.value.clone()

    def writes():
        x.assign(torch.tensor([np.nan, np.inf, -np.inf]))
        x.assign_add(torch.tensor([np.nan, 1.0, 1.0]))
        x.assign_sub(np.inf)
        counter.assign_add(1)

    control.cond(torch.tensor(False), writes, None, [x, counter])
    # Bit for bit, including the sign of zero.
    assert torch.equal(x.value.view(torch.int32), before.view(torch.int32))
    assert int(counter.value) == 3 and counter.dtype == "int32"


def test_a_branch_taken_equals_plain_writes():
    rng = np.random.default_rng(0)
    b = torch.tensor(rng.normal(size=5))
    plain, branched = variable(rng.normal(size=5)), None
    branched = ls.Variable(plain.value.clone())
    for op in ("assign_add", "assign_sub", "assign"):
        getattr(plain, op)(b)
        control.cond(torch.tensor(True), lambda op=op: getattr(branched, op)(b), None, [branched])
        assert torch.equal(plain.value, branched.value)


def test_a_branch_on_a_parameter_keeps_autograd_state():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    v = ls.Variable(p)
    control.cond(torch.tensor(True), lambda: v.assign_sub(torch.tensor([0.5, 0.5])), None, [v])
    assert p.requires_grad and p.grad_fn is None and p.tolist() == [0.5, 1.5]


@pytest.mark.parametrize(
    "make",
    [
        lambda: SGD(0.1, momentum=0.9),
        lambda: Adam(0.01),
        lambda: RMSprop(0.01, centered=True),
        lambda: Adam(0.01, gradient_accumulation_steps=2),
        lambda: SGD(0.1, use_ema=True, ema_overwrite_frequency=2),
    ],
)
def test_a_step_on_device_flags_equals_a_host_if_step(monkeypatch, make):
    """A LossScaleOptimizer step deciding on the device gives the results of a host `if`."""

    def host_cond(pred, true_fn, false_fn, variables):
        branch = true_fn if bool(pred) else false_fn
        if branch is not None:
            branch()

    runs = []
    for cond in (control.cond, host_cond):
        monkeypatch.setattr(torch_backend, "cond", cond)
        rng = np.random.default_rng(1)
        params = [torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in SHAPES]
        opt = ls.LossScaleOptimizer(make(), initial_scale=4.0, dynamic_growth_steps=2)
        for kind in ["f", "inf", "f", "nan", "nan", "f", "f", "f"]:
            grads = inject(random_grads(rng, 4.0), kind)
            if cond is host_cond:
                # The inner step's flag read on the host: the skip by `if`.
                inner = opt.inner_optimizer
                planned = type(inner)._step_plan
                monkeypatch.setattr(
                    inner,
                    "_step_plan",
                    lambda variables, inner=inner, planned=planned: dataclasses.replace(
                        planned(inner, variables), folds_keep=False
                    ),
                )
            apply(opt, [torch.tensor(g) for g in grads], params)
        runs.append([p.clone() for p in params] + [v.value.clone() for v in opt.variables])
    for branched, plain in zip(*runs):
        assert torch.equal(branched, plain)
