"""torch/optimizer_checkpoint.py: `lossscale.torch.Optimizer.state_dict` / `load_state_dict`.

torch's layout (parameters numbered across the groups, each group's rule
variables in its entry): a round trip through `torch.save` with a torch
scheduler resumes exactly, the dict is a snapshot, and a dict that does not
fit raises, naming what is wrong, before anything is written. The
parameter and gradient helpers are test_optimizer.py's.
"""

import io

import pytest
import torch

import lossscale as ls
import lossscale.torch as lt
from tests.torch.test_optimizer import grads_for, make_params, set_grads


def test_state_dict_round_trip_resumes_exactly():
    params = make_params()
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 0.02}]
    opt = lt.Optimizer(groups, ls.optimizers.Adam(0.01, amsgrad=True))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
    for step in range(3):
        set_grads(params, grads_for(step))
        opt.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": scheduler.state_dict(), "params": params}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert sorted(saved["opt"]["state"]) == [0, 1, 2]
    assert saved["opt"]["param_groups"][1]["params"] == [1, 2]
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in saved["params"]]
    twin = lt.Optimizer(
        [{"params": twin_params[:1]}, {"params": twin_params[1:], "lr": 0.02}],
        ls.optimizers.Adam(0.01, amsgrad=True),
    )
    twin_scheduler = torch.optim.lr_scheduler.LambdaLR(twin, lambda e: 0.5**e)
    twin.load_state_dict(saved["opt"])
    twin_scheduler.load_state_dict(saved["sched"])
    for step in range(3, 6):
        for ps, o, s in ((params, opt, scheduler), (twin_params, twin, twin_scheduler)):
            set_grads(ps, grads_for(step))
            o.step()
            s.step()
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    assert [g["lr"] for g in twin.param_groups] == [g["lr"] for g in opt.param_groups]


def test_state_dict_is_a_snapshot():
    params = make_params()
    opt = lt.Optimizer(params, ls.optimizers.Adam(0.01))
    set_grads(params, grads_for(0))
    opt.step()
    saved = opt.state_dict()
    frozen = saved["state"][0]["momentum"].clone()
    set_grads(params, grads_for(1))
    opt.step()
    assert torch.equal(saved["state"][0]["momentum"], frozen)


def _two_groups():
    params = make_params()
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 0.02}]
    opt = lt.Optimizer(groups, ls.optimizers.Adam(0.01))
    set_grads(params, grads_for(0))
    opt.step()
    return opt


def _native_state_dict():
    native = torch.optim.Adam(make_params())
    native.step()
    return native.state_dict()


def _changed(change):
    def make(good):
        bad = {
            "state": dict(good["state"]),
            "param_groups": [dict(g) for g in good["param_groups"]],
        }
        change(bad)
        return bad

    return make


def _set(path, value):
    def change(bad):
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


BAD = {
    "not_a_dict": (
        lambda good: [good],
        r"^`state_dict` must be a dict with keys \['state', 'param_groups'\], as "
        r"Optimizer.state_dict\(\) returns it. Received: list$",
    ),
    "extra_key": (
        lambda good: {**good, "optimizer_variables": {}},
        r"with keys \['state', 'param_groups'\], .* Received: \['optimizer_variables', "
        r"'param_groups', 'state'\]$",
    ),
    "one_group": (
        _changed(lambda bad: bad["param_groups"].pop()),
        r"^`state_dict\['param_groups'\]` must hold 2 groups, one per param group of this "
        r"optimizer. Received: \[\{",
    ),
    "torch_optimizer": (
        lambda good: _native_state_dict(),
        r"must hold 2 groups",
    ),
    "no_rule_variables": (
        _changed(lambda bad: bad["param_groups"][1].pop("optimizer_variables")),
        r"^`state_dict\['param_groups'\]\[1\]` has no 'optimizer_variables': this is not the "
        r"state dict of a Optimizer \(a torch optimizer's, say\). Received keys: \[",
    ),
    "params_renumbered": (
        _changed(_set(("param_groups", 1, "params"), [0, 1])),
        r"^`state_dict\['param_groups'\]\[1\]\['params'\]` must list the 2 parameters of "
        r"group 1 \(1 to 2\). Received: \[0, 1\]$",
    ),
    "unknown_parameter": (
        _changed(_set(("state", 3), {})),
        r"^`state_dict\['state'\]` names parameters \[3\] that this optimizer does not have "
        r"\(it has 3\).$",
    ),
    "slot_shape": (
        _changed(_set(("state", 2), {"momentum": torch.zeros(4, 3), "velocity": torch.zeros(3)})),
        r"must have the shape \(4, 3\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_state_dict_that_does_not_fit_raises_and_writes_nothing(case):
    opt = _two_groups()
    good = opt.state_dict()
    make, message = BAD[case]
    bad = make(good)
    opt.param_groups[0]["lr"] = 0.5  # a hyperparameter a load would restore
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.02]
    assert sorted(after["state"]) == sorted(good["state"]) == [0, 1, 2]
    for i, slots in good["state"].items():
        assert sorted(after["state"][i]) == sorted(slots)
        for key, value in slots.items():
            assert torch.equal(after["state"][i][key], value), (i, key)
    for a, b in zip(after["param_groups"], good["param_groups"]):
        assert a["optimizer_variables"].keys() == b["optimizer_variables"].keys()
        for path, value in b["optimizer_variables"].items():
            assert torch.equal(a["optimizer_variables"][path], value), path


def test_a_load_restores_each_group_s_hyperparameters_as_torch_does():
    opt = _two_groups()
    saved = opt.state_dict()
    saved["param_groups"][0]["initial_lr"] = 0.01  # what a scheduler adds
    twin = _two_groups()
    for group in twin.param_groups:
        group["lr"] = 1.0
    twin.load_state_dict(saved)
    assert [g["lr"] for g in twin.param_groups] == [0.01, 0.02]
    assert twin.param_groups[0]["initial_lr"] == 0.01 and "initial_lr" not in twin.param_groups[1]
    assert all("optimizer_variables" not in g for g in twin.param_groups)
    assert [len(g["params"]) for g in twin.param_groups] == [1, 2]
