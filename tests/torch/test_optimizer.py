"""lossscale.torch.Optimizer: a torch.optim.Optimizer running a lossscale optimizer."""

import copy
import io
import pickle
import warnings

import numpy as np
import pytest
import torch

import lossscale as ls
import lossscale.torch as lt
from tests.torch_cases import OPTIMIZERS, no_host_reads

SHAPES = [(6, 4), (4,), (4, 3)]


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def grads_for(step, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_rule_runs_as_the_lossscale_optimizer_does(name):
    params, twins = make_params(), [ls.Variable(p.detach().clone()) for p in make_params()]
    opt, rule = lt.Optimizer(params, OPTIMIZERS[name]()), OPTIMIZERS[name]()
    for step in range(4):
        grads = grads_for(step)
        set_grads(params, grads)
        opt.step()
        rule.apply(grads, twins)
    for p, t in zip(params, twins):
        assert torch.equal(p.detach(), t.value)
    for ours, theirs in zip(opt.rules[0].variables, rule.variables):
        assert torch.equal(ours.value, theirs.value)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_and_param_groups_name_the_rules_live_tensors(name):
    params = make_params()
    opt = lt.Optimizer([{"params": params[:2]}], OPTIMIZERS[name]())
    opt.add_param_group({"params": params[2:], "lr": 0.5})
    # Every parameter has an entry from the start (torch's distributed
    # checkpoint steps an optimizer whose `state` is empty).
    assert list(opt.state) == params
    before = {id(p): dict(opt.state[p]) for p in params}
    for step in range(2):
        set_grads(params, grads_for(step))
        opt.step()
    saved = opt.state_dict()
    for i, p in enumerate(params):
        slots = opt.state[p]
        assert sorted(slots) == sorted(saved["state"].get(i, {}))
        for key, tensor in slots.items():
            assert tensor is before[id(p)][key]  # the same tensors, written in place
            assert torch.equal(tensor, saved["state"][i][key])
    for group, saved_group in zip(opt.param_groups, saved["param_groups"]):
        live, copies = group["optimizer_variables"], saved_group["optimizer_variables"]
        assert live.keys() == copies.keys() and live
        for path, tensor in live.items():
            assert torch.equal(tensor, copies[path]) and tensor is not copies[path]


def test_parameters_without_gradients_are_left_alone():
    params = make_params()
    opt = lt.Optimizer(params, ls.optimizers.Adam(0.1))
    before = params[1].detach().clone()
    set_grads(params, [grads_for(0)[0], None, grads_for(0)[2]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Gradients do not exist" warning, as in torch
        opt.step()
    assert torch.equal(params[1].detach(), before)
    assert not torch.equal(params[0].detach(), make_params()[0])


def test_param_groups_set_their_own_learning_rate_and_weight_decay():
    params = make_params()
    opt = lt.Optimizer(
        [{"params": params[:2], "lr": 0.05}, {"params": params[2:], "weight_decay": 0.0}],
        ls.optimizers.AdamW(0.01, weight_decay=0.1),
    )
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.01]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    first = ls.optimizers.AdamW(0.05, weight_decay=0.1)
    second = ls.optimizers.Adam(0.01)  # no decay at all: AdamW with weight_decay 0
    twins = [ls.Variable(p.detach().clone()) for p in params]
    for step in range(3):
        grads = grads_for(step)
        set_grads(params, grads)
        opt.step()
        first.apply(grads[:2], twins[:2])
        second.apply(grads[2:], twins[2:])
    for p, t in zip(params, twins):
        assert torch.equal(p.detach(), t.value)


def schedulers():
    return {
        "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e),
        "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.05, total_steps=8
        ),  # cycles the betas too
    }


@pytest.mark.parametrize("kind", sorted(schedulers()))
def test_torch_schedulers_drive_the_rule(kind):
    params = make_params()
    opt = lt.Optimizer(params, ls.optimizers.Adam(0.01))
    scheduler = schedulers()[kind](opt)
    twins = [ls.Variable(p.detach().clone()) for p in params]
    twin = ls.optimizers.Adam(0.01)
    seen = []
    for step in range(6):
        group = opt.param_groups[0]
        twin.build(twins)
        twin.learning_rate = group["lr"]
        twin.beta_1, twin.beta_2 = group["betas"]
        seen.append((group["lr"], group["betas"][0]))
        grads = grads_for(step)
        set_grads(params, grads)
        opt.step()
        twin.apply(grads, twins)
        scheduler.step()
    assert len({lr for lr, _ in seen}) > 3
    if kind == "one_cycle":
        assert len({beta for _, beta in seen}) > 3
    for p, t in zip(params, twins):
        assert torch.equal(p.detach(), t.value)


@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, lt.GradScaler])
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_clip_step"])
def test_under_a_grad_scaler_a_skipped_step_changes_nothing(scaler_class, unscale_first):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = lt.Optimizer(model.parameters(), ls.optimizers.AdamW(1e-2, weight_decay=0.1))
    scaler = scaler_class("cpu", init_scale=2.0**20, growth_interval=2)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    skipped = 0
    for step in range(8):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss * (float("inf") if step == 3 else 1.0)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        state = [v.value.clone() for v in opt.rules[0].variables]
        if unscale_first:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with no_host_reads():  # the scaler hands over found_inf: nothing is read
            scaler.step(opt)
        scale = scaler.get_scale()
        scaler.update()
        if scaler.get_scale() < scale:  # overflowed: skipped, bit for bit
            skipped += 1
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
            assert all(torch.equal(s, v.value) for s, v in zip(state, opt.rules[0].variables))
    assert skipped >= 2  # the forced inf, and the float16 overflows of 2**20
    assert int(opt.rules[0].iterations) == 8 - skipped


@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, lt.GradScaler])
def test_a_scaler_step_leaves_the_unscaled_gradients_in_p_grad(scaler_class):
    # Handed `grad_scale`, the optimizer unscales `p.grad` in place, as
    # torch's fused AdamW does: after the step `.grad` holds the unscaled
    # gradient, bit for bit torch's (a power-of-two scale).
    scale = 2.0**11
    grads = [g * scale for g in grads_for(0)]
    ours, theirs = make_params(), make_params()
    set_grads(ours, grads)
    set_grads(theirs, grads)
    opt = lt.Optimizer(ours, ls.optimizers.AdamW(1e-2))
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    for optimizer in (opt, torch_opt):
        scaler = scaler_class("cpu", init_scale=scale)
        scaler.scale(torch.ones(()))
        scaler.step(optimizer)
        scaler.update()
    for p, q, g in zip(ours, theirs, grads_for(0)):
        assert torch.equal(p.grad, q.grad)
        assert torch.equal(p.grad, g)  # exactly: times 2**11, divided by 2**11


def test_the_same_loop_as_torch_adamw_under_torch_grad_scaler():
    # Not the same rule (Keras's AdamW decays by lr, torch's by lr as well but
    # multiplies; epsilon sits elsewhere), so the same skips and scales.
    runs = []
    for make in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        lambda ps: lt.Optimizer(ps, ls.optimizers.AdamW(1e-2)),
    ):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = make(model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        scales = []
        for _ in range(8):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append(scales)
    assert runs[0] == runs[1] and min(runs[0]) < 2.0**24


def test_bad_input_raises_and_changes_nothing():
    params = make_params()
    with pytest.raises(ValueError, match=r"lists the same tensor twice.*shape \(6, 4\)"):
        lt.Optimizer([params[0], params[0]], ls.optimizers.Adam())
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        lt.Optimizer([params[0] * 2], ls.optimizers.Adam())
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        lt.Optimizer([{"params": params[:2]}, {"params": params[1:]}], ls.optimizers.Adam())
    with pytest.raises(ValueError, match="not a LossScaleOptimizer. Received"):
        lt.Optimizer(params, ls.LossScaleOptimizer(ls.optimizers.Adam()))
    with pytest.raises(ValueError, match="must be a lossscale optimizer"):
        lt.Optimizer(params, torch.optim.Adam(params))
    with pytest.raises(ValueError, match="must be a float: schedule it with a torch LR scheduler"):
        lt.Optimizer(params, ls.optimizers.Adam(ls.schedules.ExponentialDecay(0.1, 10, 0.5)))
    built = ls.optimizers.Adam()
    built.build([ls.Variable(torch.zeros(2))])
    with pytest.raises(ValueError, match="must not be built yet"):
        lt.Optimizer(params, built)

    opt = lt.Optimizer(params, ls.optimizers.Adam(0.01))
    set_grads(params, grads_for(0))
    opt.step()
    after = opt.state_dict()
    set_grads(params, grads_for(1))
    opt.found_inf = torch.zeros((), device="meta")
    try:
        with pytest.raises(ValueError, match=r"`found_inf` must be on the parameters' device cpu"):
            opt.step()
    finally:
        del opt.found_inf
    assert torch.equal(opt.state_dict()["state"][0]["momentum"], after["state"][0]["momentum"])


def _snapshot(opt, params):
    """Host copies of everything a step writes: parameters, slots, step counts, rates."""
    state = opt.state_dict()["state"]
    return (
        [p.detach().clone() for p in params],
        {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)} for k, v in state.items()},
        [(float(r.iterations.numpy()), float(r.learning_rate.numpy())) for r in opt.rules],
    )


def _same(a, b):
    return (
        all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k][n], b[1][k][n]) for k in a[1] for n in a[1][k])
        and a[2] == b[2]
    )


@pytest.mark.parametrize(
    "bad", ["sparse gradient", "momentum to 0", "negative weight decay", "found_inf elsewhere"]
)
def test_a_bad_group_raises_before_any_group_is_written(bad):
    # Group 0 comes first and is fine; nothing of it (parameters, slots,
    # step count, its moved learning rate) changes when group 1 is refused.
    params = make_params()
    embedding = torch.nn.Embedding(10, 4)
    opt = lt.Optimizer(
        [{"params": params}, {"params": [embedding.weight], "lr": 0.5}],
        ls.optimizers.SGD(0.01, momentum=0.9),
    )
    for step in range(2):
        set_grads(params, grads_for(step))
        embedding(torch.tensor([1, 2, step])).square().sum().backward()
        opt.step()
        embedding.weight.grad = None
    set_grads(params, grads_for(2))
    embedding(torch.tensor([3, 4])).square().sum().backward()
    opt.param_groups[0]["lr"] = 0.25
    if bad == "sparse gradient":  # as `Embedding(sparse=True)` makes it
        embedding.weight.grad = embedding.weight.grad.to_sparse()
        message = (
            r"takes dense gradients only \(an embedding with `sparse=False`, say\)\. Received: "
            r"a gradient with layout torch\.sparse_coo for parameter 0 of param group 1 "
            r"\(shape \(10, 4\)\)$"
        )
    elif bad == "momentum to 0":
        opt.param_groups[1]["momentum"] = 0.0
        message = (
            r"'momentum' cannot move .* Received: momentum=0.0 for a rule built with momentum=0.9$"
        )
    elif bad == "negative weight decay":
        opt.param_groups[1]["weight_decay"] = -0.1
        message = r"`weight_decay` must be .*0.* Received: weight_decay=-0.1"
    else:  # as a scaler would set it, on a device other than the parameters'
        opt.found_inf = torch.zeros((), device="meta")
        message = r"`found_inf` must be on the parameters' device cpu.*Received: found_inf on meta"
    before = _snapshot(opt, params + [embedding.weight])
    with pytest.raises(ValueError, match=message):
        opt.step()
    opt.__dict__.pop("found_inf", None)
    assert _same(_snapshot(opt, params + [embedding.weight]), before)


def lightning_regression(rule):
    """A small Lightning regression whose optimizer is `lt.Optimizer(rule())` under a StepLR."""
    import pytorch_lightning as pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            opt = lt.Optimizer(self.parameters(), rule())
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return Regression()


def lightning_data():
    """64 examples of 8 features and their sum."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def test_inside_lightning_with_its_16_mixed_precision():
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.precision import MixedPrecision

    # Lightning refuses `gradient_clip_val` for an optimizer that unscales
    # itself (as for torch's fused ones): the rule clips, after unscaling.
    def rule():
        return ls.optimizers.AdamW(1e-2, global_clipnorm=0.5)

    data = lightning_data()
    scaler = lt.GradScaler("cpu", init_scale=2.0**20, growth_interval=3, telemetry=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = lightning_regression(rule)
    start = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    opt = trainer.optimizers[0]
    skipped = scaler.summary()["skipped_steps"]
    assert isinstance(opt, lt.Optimizer) and skipped >= 1
    assert int(opt.rules[0].iterations) == 16 - skipped
    # 16 batches (2 epochs of 8): Lightning steps the scheduler after each,
    # skipped or not (see test_skip_aware_scheduler for the other way).
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**4)
    assert not all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    assert np.isfinite(sum(float(p.detach().sum()) for p in model.parameters()))


def test_accelerate_prepares_it_and_steps_it_with_our_scaler():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True)
        accelerator.scaler = lt.GradScaler("cpu", init_scale=2.0**10)  # before prepare()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = lt.Optimizer(model.parameters(), ls.optimizers.AdamW(0.1))
        model, prepared = accelerator.prepare(model, opt)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
        changed = []
        for step in range(4):
            loss = model(x).square().mean() * (float("inf") if step == 1 else 1.0)
            accelerator.backward(loss)  # scaler.scale(loss).backward()
            before = [p.detach().clone() for p in model.parameters()]
            prepared.step()  # scaler.step(opt), scaler.update()
            prepared.zero_grad()
            changed.append(not all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        # The overflowing step changed nothing. (Accelerate's `step_was_skipped`
        # watches whether `step()` was called at all, which a scaler does for
        # an optimizer that skips by itself, as for torch's fused ones.)
        assert changed == [True, False, True, True]
        assert int(opt.rules[0].iterations) == 3
        assert accelerator.scaler.get_scale() == 2.0**9
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize("host_readable", [True, False], ids=["cpu", "device_path"])
def test_under_a_grad_scaler_adamw_takes_the_scale_into_its_kernel(monkeypatch, host_readable):
    # No unscale pass of its own (`_foreach_div_`): the fused kernel divides
    # each gradient by `grad_scale` as it reads it, as torch's AdamW does.
    # On the CPU the step size is computed on the host and the decay folded
    # into torch's fused AdamW kernel; the device path (a GPU's) is forced
    # by making the CPU not host-readable.
    from lossscale.backends.torch import multi
    from tests.torch_cases import count_ops

    if not host_readable:
        monkeypatch.setattr(multi, "HOST_READABLE", frozenset())
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32, generator=generator)) for _ in range(16)]
    opt = lt.Optimizer(params, ls.optimizers.AdamW(1e-2, weight_decay=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(64, 32, generator=generator) * 1024
        scaler.scale(torch.ones(()))
        with count_ops() as ops:
            scaler.step(opt)
        scaler.update()
    assert not [op for op in ops if "div_" in op or "_foreach_div" in op], ops
    ours = [op for op in ops[ops.index("aten.eq.Scalar") :] if not op.startswith("profiler")]
    if host_readable:
        # The flag, the step count read on the host, Adam with the decay
        # (given the scaler's own found_inf), the step count.
        assert ours == [
            "aten.eq.Scalar",
            "aten._local_scalar_dense.default",
            "aten._fused_adamw_.default",
            "aten.add_.Tensor",
        ]
        return
    assert "aten._fused_adam_.tensor_lr" in ops
    # The flag, the decay (select, multiply), the step size (6), Adam (given
    # the scaler's own found_inf, not one made again), the step count.
    assert len(ours) == 11, ours
    assert "aten.where.self" not in ours[ours.index("aten.add.out") :], ours


@pytest.mark.parametrize("all_have_grads", [True, False])
def test_a_step_hands_the_rule_its_own_variables_and_resolves_none(monkeypatch, all_have_grads):
    # The rule resolves nothing (no `_as_variable` per parameter): it is
    # given its own variable list, or, where some parameter has no
    # gradient, its own variables of the others.
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(5)]
    opt = lt.Optimizer(params, ls.optimizers.AdamW(1e-2))
    rule = opt.rules[0]
    resolved = []
    as_variable = type(rule)._as_variable
    monkeypatch.setattr(
        type(rule), "_as_variable", lambda self, x: resolved.append(x) or as_variable(self, x)
    )
    before = [p.detach().clone() for p in params]
    for p in params[: 5 if all_have_grads else 4]:
        p.grad = torch.ones(4, 3)
    opt.step()
    assert resolved == []
    changed = [not torch.equal(b, p) for b, p in zip(before, params)]
    assert changed == [True] * 4 + [all_have_grads]


def test_param_groups_given_as_generators_are_read_once_as_torch_reads_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))

    def groups():
        return [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-3}]

    ours = lt.Optimizer(groups(), ls.optimizers.AdamW(1e-2))
    theirs = torch.optim.AdamW(groups(), lr=1e-2)
    assert [len(g["params"]) for g in ours.param_groups] == [2, 2]
    assert [len(g["params"]) for g in theirs.param_groups] == [2, 2]
    extra = torch.nn.Linear(2, 3)
    ours.add_param_group({"params": extra.parameters()})
    assert [len(g["params"]) for g in ours.param_groups] == [2, 2, 2]
    assert [len(r.variables) for r in ours.rules] == [6, 6, 6]  # 2 counters + 2x2 moments
    with pytest.raises(TypeError, match="ordered collections"):  # torch's own error
        lt.Optimizer([{"params": set(model.parameters())}], ls.optimizers.AdamW(1e-2))


def test_an_empty_param_group_is_kept_and_never_stepped():
    """The decay / no-decay split of a model without biases or norms (docs/torch_optim.md)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 2, bias=False)
    )
    groups = [{"params": list(model.parameters())}, {"params": [], "weight_decay": 0.0}]
    opt = lt.Optimizer(groups, ls.optimizers.AdamW(1e-2, weight_decay=0.05))
    reference = lt.Optimizer(
        [{"params": [p.detach().clone().requires_grad_() for p in model.parameters()]}],
        ls.optimizers.AdamW(1e-2, weight_decay=0.05),
    )
    for step in range(3):
        model.zero_grad()
        model(torch.full((1, 4), 1.0 + step)).sum().backward()
        for p, q in zip(model.parameters(), reference.param_groups[0]["params"]):
            q.grad = p.grad.clone()
        opt.step()
        reference.step()
    for p, q in zip(model.parameters(), reference.param_groups[0]["params"]):
        assert torch.equal(p, q)
    saved = opt.state_dict()
    assert (
        saved["param_groups"][1]["params"] == []
        and saved["param_groups"][1]["optimizer_variables"] == {}
    )
    again = lt.Optimizer(
        [{"params": list(model.parameters())}, {"params": [], "weight_decay": 0.0}],
        ls.optimizers.AdamW(1e-2, weight_decay=0.05),
    )
    again.load_state_dict(saved)
    assert torch.equal(again.rules[0].iterations.value, opt.rules[0].iterations.value)
    wrong = {**saved, "param_groups": [saved["param_groups"][0], dict(saved["param_groups"][1])]}
    wrong["param_groups"][1]["optimizer_variables"] = saved["param_groups"][0][
        "optimizer_variables"
    ]
    with pytest.raises(ValueError, match=r"group 1 of this optimizer has no parameters"):
        again.load_state_dict(wrong)


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
    # A step count below 0: the next step's bias correction writes NaN into every weight.
    "negative_iteration": (
        _changed(
            lambda bad: bad["param_groups"][1].update(
                optimizer_variables={
                    **bad["param_groups"][1]["optimizer_variables"],
                    "adam_group1/iteration": torch.tensor(-1),
                }
            )
        ),
        r"holds -1, but the optimizer's step count must be an integer >= 0. Nothing was loaded.",
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
