"""torch/optimizer_checkpoint.py: `lossscale.torch.Optimizer.state_dict` / `load_state_dict`.

torch's layout (parameters numbered across the groups, each group's rule
variables in its entry): a round trip through `torch.save` with a torch
scheduler resumes exactly, the dict is a snapshot, and a dict that does not
fit raises, naming what is wrong, before anything is written. torch's
distributed checkpoint (`get_state_dict` / `set_state_dict`, `dcp.save` /
`dcp.load`, nested and flattened) saves without stepping the optimizer and
resumes exactly, in one process and under FSDP2 on two ranks. A copy of
the optimizer itself (`copy.deepcopy`, `pickle`, `torch.save`) trains on
as the original. The parameter and gradient helpers are test_optimizer.py's.
"""

import copy
import io
import pickle
import warnings

import numpy as np
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
    "params_listed_twice": (
        _changed(_set(("param_groups", 1, "params"), [0, 1])),
        r"^`state_dict\['param_groups'\]\[1\]\['params'\]` lists 0, which an earlier entry "
        r"lists too: each parameter is listed once.$",
    ),
    "params_count": (
        _changed(_set(("param_groups", 1, "params"), [1])),
        r"^`state_dict\['param_groups'\]\[1\]\['params'\]` must list the 2 parameters of "
        r"group 1, one id each. Received: \[1\]$",
    ),
    "unknown_parameter": (
        _changed(_set(("state", 3), {})),
        r"^`state_dict\['state'\]` names parameters \[3\] that no group of "
        r"`state_dict\['param_groups'\]` lists \(this optimizer has 3\).$",
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
    # Each live group names its rule's variables (not the saved copies).
    for group, rule in zip(twin.param_groups, twin.rules):
        live = {path: v.value for path, v in rule.state_variables()[1].items()}
        assert group["optimizer_variables"].keys() == live.keys()
        assert all(group["optimizer_variables"][k] is live[k] for k in live)
    assert [len(g["params"]) for g in twin.param_groups] == [1, 2]


# --- torch's distributed checkpoint (DCP): the FSDP2 way to save ---------------
RULES = {
    "adamw": lambda: ls.optimizers.AdamW(0.01, weight_decay=0.1),
    "adam_amsgrad": lambda: ls.optimizers.Adam(0.01, amsgrad=True),
    "sgd_momentum": lambda: ls.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "sgd": lambda: ls.optimizers.SGD(0.05),  # no slots at all
}


def _model_and_optimizer(rule, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.LayerNorm(96), torch.nn.Linear(96, 10)
    )
    decayed = [p for n, p in model.named_parameters() if n.endswith("weight") and p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.ndim > 1)]
    groups = [{"params": decayed}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]
    return model, lt.Optimizer(groups, RULES[rule]())


def _train(model, opt, steps):
    for step in steps:
        inputs = torch.randn(32, 48, generator=torch.Generator().manual_seed(step))
        model(inputs).square().mean().backward()
        opt.step()
        opt.zero_grad()  # grads None, as a checkpointing loop leaves them


def _assert_same_state(a, b):
    assert sorted(a["state"]) == sorted(b["state"])
    for i, slots in a["state"].items():
        assert slots.keys() == b["state"][i].keys()
        for key, value in slots.items():
            assert torch.equal(value, b["state"][i][key]), (i, key)
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        assert {k: v for k, v in ga.items() if k != "optimizer_variables"} == {
            k: v for k, v in gb.items() if k != "optimizer_variables"
        }
        for path, value in ga["optimizer_variables"].items():
            assert torch.equal(value, gb["optimizer_variables"][path]), path


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_distributed_checkpoint_saves_without_a_step_and_resumes_exactly(rule, flatten, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    options = dsd.StateDictOptions(flatten_optimizer_state_dict=flatten)
    model, opt = _model_and_optimizer(rule, seed=0)
    _train(model, opt, range(3))
    before = opt.state_dict()
    model_sd, optim_sd = dsd.get_state_dict(model, opt, options=options)
    # Taking the dict steps nothing: torch's helper steps an optimizer whose
    # `state` is empty (zero gradients, lr 0), which would decay the moments
    # and count a step at every save.
    _assert_same_state(opt.state_dict(), before)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    _train(model, opt, range(3, 6))

    twin, twin_opt = _model_and_optimizer(rule, seed=1)  # other weights, fresh state
    twin_model_sd, twin_optim_sd = dsd.get_state_dict(twin, twin_opt, options=options)
    loaded = {"model": twin_model_sd, "optim": twin_optim_sd}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    dsd.set_state_dict(
        twin,
        twin_opt,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optim"],
        options=options,
    )
    _assert_same_state(twin_opt.state_dict(), before)
    _train(twin, twin_opt, range(3, 6))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    _assert_same_state(twin_opt.state_dict(), opt.state_dict())


def test_a_load_takes_the_groups_lr_over_the_lr_the_rule_was_saved_with():
    params = make_params()
    opt = lt.Optimizer(params, ls.optimizers.Adam(0.01))
    set_grads(params, grads_for(0))
    opt.step()
    saved = opt.state_dict()
    (lr_path,) = [p for p in saved["param_groups"][0]["optimizer_variables"] if "learning" in p]
    saved["param_groups"][0]["optimizer_variables"][lr_path] = torch.tensor(0.0)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = lt.Optimizer(twin_params, ls.optimizers.Adam(0.01))
    twin.load_state_dict(saved)
    for ps, o in ((params, opt), (twin_params, twin)):
        set_grads(ps, grads_for(1))
        o.step()
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)


def test_a_load_maps_any_parameter_ids_by_position_as_torch_does():
    opt = _two_groups()
    saved = opt.state_dict()
    names = {0: "a.weight", 1: "b.weight", 2: "b.bias"}
    renamed = {
        "state": {names[i]: slots for i, slots in saved["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]
        ],
    }
    twin = _two_groups()
    set_grads(twin.param_groups[0]["params"] + twin.param_groups[1]["params"], grads_for(5))
    twin.step()  # now unlike `opt`
    twin.load_state_dict(renamed)
    _assert_same_state(twin.state_dict(), saved)


# --- the same under FSDP2, two gloo ranks (tests/workers/fsdp2_checkpoint_worker.py;
# the `fsdp2_checkpoint_ranks` fixture is in tests/conftest.py) ---
@pytest.mark.xdist_group("torch_distributed")
@pytest.mark.parametrize("layout", ["nested", "flattened"])
@pytest.mark.parametrize("rule", ["adamw", "sgd_momentum", "sgd"])
def test_fsdp2_saves_with_dcp_and_resumes_exactly(fsdp2_checkpoint_ranks, rule, layout):
    from tests.workers import fsdp2_checkpoint_worker as worker

    key = f"{rule}-{layout}"
    for rank in fsdp2_checkpoint_ranks:
        assert not rank[f"{key}/changed_by_get"]
        scales = rank[f"{key}/scales"]
        # The poisoned step (an inf in rank 1's shard alone) was skipped by both.
        assert scales[worker.POISONED] == scales[worker.POISONED - 1] / 2
        assert list(rank[f"{key}/resumed_scales"]) == list(scales[worker.SAVED :])
        count = len([k for k in rank if k.startswith(f"{key}/param")])
        assert count == 4
        for i in range(count):
            assert np.array_equal(rank[f"{key}/param{i}"], rank[f"{key}/resumed_param{i}"])
    for i in range(4):
        assert np.array_equal(
            fsdp2_checkpoint_ranks[0][f"{key}/param{i}"],
            fsdp2_checkpoint_ranks[1][f"{key}/param{i}"],
        )


def test_lightning_resumes_from_its_checkpoint_exactly(tmp_path):
    """`Trainer.fit(ckpt_path=...)` with `lossscale.torch.Optimizer`, our GradScaler and a scheduler.

    Lightning saves the optimizer's and the scheduler's `state_dict()` and
    the scaler's (its precision plugin's), and restores them: 2 epochs, a
    checkpoint, 2 more from it end bit for bit where 4 in one go do, with
    the same overflows skipped.
    """
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.precision import MixedPrecision

    from tests.torch.test_optimizer import lightning_data, lightning_regression

    loader = torch.utils.data.DataLoader(lightning_data(), batch_size=8)

    def fit(epochs, ckpt_path=None, save=False):
        scaler = lt.GradScaler("cpu", init_scale=2.0**20, growth_interval=3, telemetry=True)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=epochs,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
            logger=False,
            default_root_dir=tmp_path,
            enable_checkpointing=save,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = lightning_regression(lambda: ls.optimizers.AdamW(1e-2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
            trainer.fit(model, loader, ckpt_path=ckpt_path)
        return trainer, model, scaler

    _, whole, whole_scaler = fit(4)
    first, _, _ = fit(2, save=True)
    _, resumed, resumed_scaler = fit(4, ckpt_path=first.checkpoint_callback.best_model_path)
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    expected, got = whole_scaler.summary(), resumed_scaler.summary()
    assert expected["skipped_steps"] == got["skipped_steps"] >= 2
    assert [o["step"] for o in expected["overflows"]] == [o["step"] for o in got["overflows"]]
    assert whole_scaler.get_scale() == resumed_scaler.get_scale()


def _copied(what, objects):
    if what == "deepcopy":
        return copy.deepcopy(objects)
    if what == "pickle":
        return pickle.loads(pickle.dumps(objects))
    buffer = io.BytesIO()
    torch.save(objects, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _scaled_steps(model, opt, scaler, scheduler, steps):
    for step in steps:
        inputs = torch.randn(32, 48, generator=torch.Generator().manual_seed(step))
        if step % 3 == 1:
            inputs[step % 32, step % 48] = float("inf")  # a skipped step
        scaler.scale(model(inputs).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        scheduler.step()
        opt.zero_grad()


@pytest.mark.parametrize("what", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_copy_of_the_optimizer_trains_on_as_the_original(rule, what):
    model, opt = _model_and_optimizer(rule, seed=4)
    scaler = lt.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _scaled_steps(model, opt, scaler, scheduler, range(3))
    twin, twin_opt, twin_scaler, twin_scheduler = _copied(what, (model, opt, scaler, scheduler))
    _assert_same_state(twin_opt.state_dict(), opt.state_dict())
    twin_params = [p for g in twin_opt.param_groups for p in g["params"]]
    assert {id(p) for p in twin_params} == {id(p) for p in twin.parameters()}  # the copy's
    assert twin_opt.last_step_applied is not None
    # The copy is its own: training it leaves the original where it was.
    before = [p.detach().clone() for p in model.parameters()]
    _scaled_steps(twin, twin_opt, twin_scaler, twin_scheduler, range(3, 7))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    _scaled_steps(model, opt, scaler, scheduler, range(3, 7))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    _assert_same_state(twin_opt.state_dict(), opt.state_dict())
    assert twin_scaler.get_scale() == scaler.get_scale()
    assert [g["lr"] for g in twin_opt.param_groups] == [g["lr"] for g in opt.param_groups]
