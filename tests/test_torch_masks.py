"""backends/torch/masks.py: branches on device values as masked writes."""

import numpy as np
import pytest
import torch
from torch_cases import SHAPES, apply, inject, random_grads

import lossscale as ls
import lossscale.backends.torch as torch_backend
from lossscale.backends.torch import masks
from lossscale.backends.torch import ops as torch_ops
from lossscale.optimizers import SGD, Adam, RMSprop


def variable(values, dtype=torch.float32):
    return ls.Variable(torch.tensor(values, dtype=dtype))


@pytest.mark.parametrize("taken", [True, False])
def test_cond_on_tensor_runs_both_branches_under_masks(taken):
    x, y = variable([1.0, 2.0]), variable([5.0])
    seen = []

    def true_fn():
        seen.append(("true", bool(x._write_mask.keep), y._write_mask is x._write_mask))
        x.assign(torch.tensor([10.0, 20.0]))

    def false_fn():
        seen.append(("false", bool(x._write_mask.keep), y._write_mask is x._write_mask))
        x.assign_add(100.0)

    masks.cond(torch.tensor(taken), true_fn, false_fn, [x, y])
    assert seen == [("true", taken, True), ("false", not taken, True)]
    assert x.value.tolist() == ([10.0, 20.0] if taken else [101.0, 102.0])
    assert x._write_mask is None and y._write_mask is None  # restored


@pytest.mark.parametrize("pred", [True, False, np.bool_(True), np.bool_(False)])
def test_cond_on_host_boolean_is_a_plain_if(pred):
    calls = []
    masks.cond(pred, lambda: calls.append("true"), lambda: calls.append("false"), [])
    assert calls == (["true"] if pred else ["false"])
    masks.cond(pred, lambda: calls.append("again"), None, [])  # no false branch
    assert calls[1:] == (["again"] if pred else [])


@pytest.mark.parametrize("outer", [True, False])
@pytest.mark.parametrize("inner", [True, False])
def test_nested_conds_combine_masks(outer, inner):
    x = variable([0.0])

    def outer_true():
        masks.cond(torch.tensor(inner), lambda: x.assign_add(1.0), lambda: x.assign_add(2.0), [x])

    masks.cond(torch.tensor(outer), outer_true, lambda: x.assign_add(4.0), [x])
    assert x.value.tolist() == [(1.0 if inner else 2.0) if outer else 4.0]


def test_a_mask_is_restored_when_the_branch_raises():
    x = variable([1.0])

    def failing():
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        masks.gated(torch.tensor(True), failing, [x])
    assert x._write_mask is None


@pytest.mark.parametrize("taken", [True, False])
def test_gated_writes_only_where_the_flag_holds(taken):
    x, counter = variable([1.0, 2.0]), variable(3, dtype=torch.int32)
    skip = torch.tensor(0.0 if taken else 1.0)
    seen = []

    def fn():
        seen.append(x._write_mask.skip(torch.device("cpu")))
        x.assign_sub(torch.tensor([0.5, 0.5]))
        counter.assign_add(1)

    masks.gated(torch.tensor(taken), fn, [x, counter], skip=skip)
    assert seen[0] is skip  # the caller's flag, not a new one
    assert x.value.tolist() == ([0.5, 1.5] if taken else [1.0, 2.0])
    assert int(counter.value) == (4 if taken else 3) and counter.dtype == "int32"
    masks.gated(False, lambda: x.assign(9.0), [x])  # a host boolean: plain `if`
    assert x.value.tolist() == ([0.5, 1.5] if taken else [1.0, 2.0])


def test_write_mask_flags():
    mask = masks.WriteMask(torch.tensor(False))
    skip = mask.skip(torch.device("cpu"))
    assert skip.dtype == torch.float32 and skip.shape == () and float(skip) == 1.0
    assert mask.skip(torch.device("cpu")) is skip  # converted once
    assert mask.on(torch.device("cpu")) is mask.keep
    assert float(masks.WriteMask(torch.tensor(True)).skip(torch.device("cpu"))) == 0.0


def test_masked_writes_never_store_values_of_the_branch_not_taken():
    x = torch.tensor([1.0, -0.0, 3.0])
    before = x.clone()
    skipped = masks.WriteMask(torch.tensor(False))
    torch_ops.assign(x, torch.tensor([np.nan, np.inf, -np.inf]), skipped)
    torch_ops.assign_add(x, torch.tensor([np.nan, 1.0, 1.0]), skipped)
    torch_ops.assign_sub(x, np.inf, skipped)
    torch_ops.assign(x, 7.0, skipped)
    # Bit for bit, including the sign of zero.
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))


def test_masked_writes_equal_plain_writes_when_taken():
    rng = np.random.default_rng(0)
    a, b = torch.tensor(rng.normal(size=5)), torch.tensor(rng.normal(size=5))
    plain, masked = a.clone(), a.clone()
    taken = masks.WriteMask(torch.tensor(True))
    for op in (torch_ops.assign_add, torch_ops.assign_sub, torch_ops.assign):
        op(plain, b)
        op(masked, b, taken)
        assert torch.equal(plain, masked)


def test_masked_write_broadcasts_and_casts_like_a_plain_one():
    taken = masks.WriteMask(torch.tensor(True))
    half = torch.zeros(2, 3, dtype=torch.float16)
    torch_ops.assign_add(half, torch.tensor([1.0, 2.0, 3.0]), taken)
    assert half.dtype == torch.float16 and half.tolist() == [[1.0, 2.0, 3.0]] * 2
    for dtype in (torch.int64, torch.int32):  # a counter's `+= 1` adds the mask itself
        counter = torch.zeros((), dtype=dtype)
        torch_ops.assign_add(counter, 1, taken)
        torch_ops.assign_add(counter, 1, masks.WriteMask(torch.tensor(False)))
        assert counter.dtype == dtype and int(counter) == 1


def test_masked_write_into_parameter_keeps_autograd_state():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    torch_ops.assign_sub(p, torch.tensor([0.5, 0.5]), masks.WriteMask(torch.tensor(True)))
    assert p.requires_grad and p.grad_fn is None and p.tolist() == [0.5, 1.5]


@pytest.mark.parametrize(
    "make",
    [lambda: SGD(0.1, momentum=0.9), lambda: Adam(0.01), lambda: RMSprop(0.01, centered=True)],
)
def test_masked_step_equals_python_if_step(monkeypatch, make):
    """A LossScaleOptimizer step under masks gives the results of a host-side `if`."""

    def host_cond(pred, true_fn, false_fn, variables):
        branch = true_fn if bool(pred) else false_fn
        if branch is not None:
            branch()

    def host_gated(pred, fn, variables, skip=None, cell=None):
        host_cond(pred, fn, None, variables)

    runs = []
    for cond, gated in ((masks.cond, masks.gated), (host_cond, host_gated)):
        monkeypatch.setattr(torch_backend, "cond", cond)
        monkeypatch.setattr(torch_backend, "gated", gated)
        rng = np.random.default_rng(1)
        params = [torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in SHAPES]
        opt = ls.LossScaleOptimizer(make(), initial_scale=4.0, dynamic_growth_steps=2)
        for kind in ["f", "inf", "f", "nan", "nan", "f", "f", "f"]:
            grads = inject(random_grads(rng, 4.0), kind)
            apply(opt, [torch.tensor(g) for g in grads], params)
        runs.append([p.clone() for p in params] + [v.value.clone() for v in opt.variables])
    for masked, plain in zip(*runs):
        assert torch.equal(masked, plain)
