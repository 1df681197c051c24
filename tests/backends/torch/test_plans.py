"""backends/torch/plans.py: cached per-(device, dtype) plans and `keep`-aware multi-tensor writes."""

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends.torch import multi as torch_multi
from lossscale.backends.torch import plans as torch_plans
from lossscale.optimizers import Adam, RMSprop
from tests.torch_cases import SHAPES, count_ops, random_grads


def built(opt, dtypes=None):
    rng = np.random.default_rng(0)
    dtypes = dtypes or [torch.float32] * len(SHAPES)
    params = [
        ls.Variable(torch.tensor(rng.normal(size=s), dtype=d), name=f"w{i}")
        for i, (s, d) in enumerate(zip(SHAPES, dtypes))
    ]
    opt.build(params)
    return params


def test_plan_groups_by_dtype_and_keeps_slots_aligned():
    opt = Adam()
    params = built(opt, [torch.float32, torch.float16, torch.float32, torch.float16])
    slots = {"momentums": opt._momentums, "velocities": opt._velocities}
    plan = torch_plans.plan(params, slots, {})
    assert [(g.dtype, g.indices) for g in plan.groups] == [
        (torch.float32, [0, 2]),
        (torch.float16, [1, 3]),
    ]
    for group in plan.groups:
        for k, i in enumerate(group.indices):
            assert group.params[k].data_ptr() == params[i].value.data_ptr()
            assert group.slots["momentums"][k].data_ptr() == opt._momentums[i].value.data_ptr()
    grads = [torch.ones(s) for s in SHAPES]
    half = plan.groups[1].grads(grads)
    assert [g.dtype for g in half] == [torch.float16] * 2
    assert [tuple(g.shape) for g in half] == [SHAPES[1], SHAPES[3]]


def test_plan_is_reused_while_nothing_is_rebound():
    opt = Adam()
    params = built(opt)
    cache = {}
    m = {"momentums": opt._momentums}
    both = {"momentums": opt._momentums, "velocities": opt._velocities}
    plan = torch_plans.plan(params, m, cache)
    assert torch_plans.plan(params, m, cache) is plan
    assert torch_plans.plan(list(params), dict(m), cache) is plan
    # Another subset, another slot list, a rebound storage: a new plan.
    assert torch_plans.plan(params[:2], {"momentums": opt._momentums[:2]}, cache) is not plan
    other = torch_plans.plan(params, both, cache)
    assert other is not plan and torch_plans.plan(params, both, cache) is other
    plan = torch_plans.plan(params, m, cache)
    opt._momentums[2].rebind(opt._momentums[2].storage.clone())
    assert torch_plans.plan(params, m, cache) is not plan
    # Another cache (another optimizer's): plans of its own.
    assert torch_plans.plan(params, m, {}) is not torch_plans.plan(params, m, cache)


def test_stateless_apply_between_steps_uses_its_own_values():
    """`stateless_apply` rebinds every storage for one call; the cache must notice."""
    rng = np.random.default_rng(4)
    params = [torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in SHAPES]
    twin_params = [p.clone() for p in params]
    opt, twin = RMSprop(0.01, momentum=0.5), RMSprop(0.01, momentum=0.5)
    for _ in range(3):
        grads = [torch.tensor(g) for g in random_grads(rng)]
        opt.apply(grads, params)
        twin.apply(grads, twin_params)
        before = [v.value.clone() for v in opt.variables] + [p.clone() for p in params]
        new_model, new_own = opt.stateless_apply([v.value for v in opt.variables], grads, params)
        after = [v.value for v in opt.variables] + params
        assert all(torch.equal(b, a) for b, a in zip(before, after))
        twin.apply(grads, twin_params)
        for a, b in zip(new_model + new_own, twin_params + [v.value for v in twin.variables]):
            assert torch.equal(a, b)
        # Back in step with the twin for the next stateful step.
        for v, value in zip(opt.variables, new_own):
            v.assign(value)
        for p, value in zip(params, new_model):
            p.copy_(value)


def test_plan_follows_loaded_values():
    opt, twin = Adam(0.01), Adam(0.01)
    params, twin_params = built(opt), built(twin)
    grads = [torch.ones(s) for s in SHAPES]
    opt.apply(grads, params)
    store = {}
    opt.save_own_variables(store)
    twin.apply(grads, twin_params)  # caches a plan on the twin
    twin.load_own_variables(store)
    for p, q in zip(params, twin_params):
        q.assign(p.value)
    opt.apply(grads, params)
    twin.apply(grads, twin_params)
    for p, q in zip(params, twin_params):
        assert torch.equal(p.value, q.value)


@pytest.mark.parametrize(
    "method,expected", [("add", [11.0, 22.0]), ("sub", [-9.0, -18.0]), ("set", [10.0, 20.0])]
)
@pytest.mark.parametrize("mask", [None, True, False])
def test_writer(mask, method, expected):
    # `mask`: the step's `keep` flag (None: no flag).
    targets = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    values = [torch.tensor([10.0, 20.0]), torch.tensor([np.nan])]
    keep = [t.clone() for t in targets]
    flag = None if mask is None else torch.tensor(mask)
    write = torch_plans.Writer(flag, torch.device("cpu"))
    written = getattr(write, method)(targets, values)
    found = write.found_inf()
    if mask is False:
        assert all(torch.equal(t, k) for t, k in zip(targets, keep))
    else:
        assert targets[0].tolist() == expected and np.isnan(targets[1].item())
    assert written[0].tolist() == expected  # what the step writes if it is taken
    assert found is None if mask is None else float(found) == float(not mask)


@pytest.mark.parametrize("taken", [True, False])
def test_masked_writes_of_many_small_tensors_are_packed(monkeypatch, taken):
    # Small tensors are selected in one packed copy, a large one on its own:
    # bit for bit what one `where` per tensor gives (signed zeros and NaNs
    # included), and a constant number of kernels however many tensors.
    monkeypatch.setattr(torch_multi, "PACK_BELOW", 8)
    rng = np.random.default_rng(3)

    def tensors(n):
        out = [torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in [(2, 3)] * n]
        out.append(torch.tensor(rng.normal(size=20), dtype=torch.float32))  # not packed
        out[0][0, 0], out[1][0, 1] = -0.0, np.nan
        return out

    write = torch_plans.Writer(torch.tensor(taken), torch.device("cpu"))
    counts = []
    for n in (4, 9):
        write.set(tensors(n), tensors(n))  # makes the packing buffers for these shapes
        targets, values = tensors(n), tensors(n)
        expected = [torch.where(torch.tensor(taken), v, t) for t, v in zip(targets, values)]
        with count_ops() as ops:
            write.set(targets, values)
        counts.append(len(ops) - 1)  # less the one `where` of the large tensor
        for t, e in zip(targets, expected):
            assert torch.equal(t.view(torch.int32), e.view(torch.int32))
    assert counts[0] == counts[1] == 4
