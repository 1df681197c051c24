"""What a learning-rate schedule does on skipped steps, through each torch interface.

- lossscale's own schedules read `iterations`, which a skipped step leaves:
  they never run ahead, with no host read.
- a torch scheduler stepped after every step runs ahead by one per skipped
  step (as with torch.amp.GradScaler and torch's optimizers);
  `AppliedStepScheduler` keeps it in step, reading one boolean per step.
"""

import pytest
import torch

import lossscale as ls
import lossscale.torch as lt
from tests.torch_cases import no_host_reads

OVERFLOW_AT = {2, 5}


def run_under_grad_scaler(wrap):
    """Eight GradScaler steps of a lossscale.torch.Optimizer, two of them overflowing."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = lt.Optimizer(model.parameters(), ls.optimizers.SGD(0.1))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    if wrap:
        schedule = lt.AppliedStepScheduler(schedule, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    used = []
    for step in range(8):
        opt.zero_grad()
        loss = model(x).square().mean() * (float("inf") if step in OVERFLOW_AT else 1.0)
        scaler.scale(loss).backward()
        used.append(opt.param_groups[0]["lr"])
        scaler.step(opt)
        scaler.update()
        schedule.step()
    return used, schedule


def test_a_torch_scheduler_runs_ahead_on_skipped_steps():
    used, _ = run_under_grad_scaler(wrap=False)
    assert used == [0.1 * 0.5**k for k in range(8)]  # 8 rates, 6 applied steps


def test_applied_step_scheduler_counts_applied_steps_only():
    used, schedule = run_under_grad_scaler(wrap=True)
    applied = [step for step in range(8) if step not in OVERFLOW_AT]
    # The rate of each applied step is the schedule at the number of applied
    # steps before it; a skipped step keeps the rate.
    expected, k = [], 0
    for step in range(8):
        expected.append(0.1 * 0.5**k)
        k += step in applied
    assert used == expected and schedule.skipped_steps == 2
    state = schedule.state_dict()
    assert state["skipped_steps"] == 2 and "scheduler" in state
    twin = run_under_grad_scaler(wrap=True)[1]
    twin.load_state_dict(state)
    assert twin.get_last_lr() == schedule.get_last_lr()


def test_lossscale_schedules_do_not_move_on_skipped_steps_and_read_nothing():
    w = ls.Variable(torch.ones(3))
    schedule = ls.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    inner = ls.optimizers.SGD(schedule)
    opt = ls.LossScaleOptimizer(inner, initial_scale=4.0)
    opt.scale_loss(1.0)
    opt.apply([torch.full((3,), 4.0)], [w])  # builds
    rates = []
    with no_host_reads():
        for step in range(1, 7):
            grad = torch.full((3,), float("inf") if step in OVERFLOW_AT else 4.0)
            rates.append(inner.learning_rate)
            opt.apply([grad], [w])
    applied_before = [sum(1 for s in range(1, k) if s not in OVERFLOW_AT) + 1 for k in range(1, 7)]
    assert [float(r) for r in rates] == pytest.approx([0.1 * 0.5**k for k in applied_before])


def test_a_loss_scale_optimizer_reports_its_skipped_steps_to_a_torch_scheduler():
    p = torch.nn.Parameter(torch.ones(3))
    native = torch.optim.SGD([p], lr=0.1)
    opt = ls.LossScaleOptimizer(lt.TorchAdapter(native), initial_scale=4.0)
    assert opt.last_step_applied is None
    schedule = lt.AppliedStepScheduler(
        torch.optim.lr_scheduler.LambdaLR(native, lambda step: 0.5**step), opt
    )
    opt.scale_loss(1.0)
    for step in range(6):
        opt.apply([torch.full((3,), float("inf") if step in OVERFLOW_AT else 4.0)], [p])
        assert bool(opt.last_step_applied) == (step not in OVERFLOW_AT)
        schedule.step()
    assert schedule.skipped_steps == 2 and native.param_groups[0]["lr"] == 0.1 * 0.5**4


def test_bad_arguments():
    opt = lt.Optimizer([torch.nn.Parameter(torch.ones(2))], ls.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="`scheduler` must be a torch.optim.lr_scheduler"):
        lt.AppliedStepScheduler(object(), opt)
    native = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(native, lambda step: 1.0)
    with pytest.raises(ValueError, match="must report whether its last step was applied"):
        lt.AppliedStepScheduler(schedule, native)
    wrapped = lt.AppliedStepScheduler(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), opt)
    with pytest.raises(ValueError, match=r"keys \['scheduler', 'skipped_steps'\]"):
        wrapped.load_state_dict({"x": 1})


def _lightning_run(override):
    """Six Lightning steps under our scaler, the loss inf at OVERFLOW_AT; the rates used."""
    import warnings

    import pytorch_lightning as pl
    from pytorch_lightning.plugins.precision import MixedPrecision

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)
            self.rates = []

        def training_step(self, batch, batch_idx):
            self.rates.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            loss = self.net(batch[0]).float().square().mean()
            return loss * (float("inf") if batch_idx in OVERFLOW_AT else 1.0)

        def configure_optimizers(self):
            opt = lt.Optimizer(self.parameters(), ls.optimizers.SGD(0.1))
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
            schedule = lt.AppliedStepScheduler(schedule, opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

        if override:
            # Lightning steps only torch's schedulers itself; it hands this
            # method any other.
            def lr_scheduler_step(self, scheduler, metric):
                scheduler.step()

    x = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=lt.GradScaler("cpu", init_scale=8.0))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
        trainer.fit(model, data)
    return model.rates


def test_under_lightning_applied_step_scheduler_needs_lr_scheduler_step():
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="doesn't follow PyTorch's LRScheduler"):
        _lightning_run(override=False)
    expected, k = [], 0
    for step in range(6):
        expected.append(0.1 * 0.5**k)
        k += step not in OVERFLOW_AT
    assert _lightning_run(override=True) == expected
