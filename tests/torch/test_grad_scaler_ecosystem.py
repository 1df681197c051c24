"""`lossscale.torch.GradScaler` where torch users plug a GradScaler in.

- torch.distributed: two gloo ranks (tests/workers/grad_scaler_worker.py), an inf
  on one rank only, with `process_group` and with an FSDP2 model;
- Lightning: `MixedPrecision("16-mixed", "cpu", scaler=...)` gives torch's
  weights with our scaler, and its checkpoint restores our scaler;
- Accelerate: on CPU (its float16 path needs a GPU), a scaler set as
  `accelerator.scaler` before `prepare` steps the prepared optimizer and is
  saved and loaded with `save_state` / `load_state`.
"""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lossscale.torch as lt
from tests import workers

WORKER = Path(__file__).parents[1] / "workers" / "grad_scaler_worker.py"


# -- torch.distributed ----------------------------------------------------------


# Session-scoped: set up once per test process, however the tests of other
# modules interleave with these in it (a module fixture is set up again then).
@pytest.fixture(scope="session")
def ranks(tmp_path_factory):
    from tests.test_distributed import free_port, launch  # retries once after a gloo teardown abort
    from tests.workers import grad_scaler_worker as worker

    out = tmp_path_factory.mktemp("grad_scaler_ranks")
    proc = launch(
        workers.command(WORKER, out, free_port()),
        finished=lambda: all((out / f"rank{r}.npz").exists() for r in (0, 1)),
        cwd=workers.ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [dict(np.load(out / f"rank{r}.npz")) for r in (0, 1)]
    return worker, results


def _runs(results, name):
    return [{k.split("/")[1]: v for k, v in r.items() if k.startswith(name + "/")} for r in results]


@pytest.mark.xdist_group("torch_distributed")  # one gloo job at a time (see test_distributed)
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_process_group_makes_every_rank_take_the_same_skip(ranks, kind):
    worker, results = ranks
    rank0, rank1 = _runs(results, f"group_{kind}")
    k = worker.POISONED
    for run in (rank0, rank1):  # the inf was on rank 1 only; both skipped and backed off
        assert run["steps"][k] == run["steps"][k - 1] == k
        assert run["scales"][k] == run["scales"][k - 1] / 2
    np.testing.assert_array_equal(rank0["scales"], rank1["scales"])
    np.testing.assert_array_equal(rank0["steps"], rank1["steps"])
    # Control: without the group, only rank 1 skips and the scales drift apart.
    alone0, alone1 = _runs(results, f"no_group_{kind}")
    assert alone0["steps"][k] == k + 1 and alone1["steps"][k] == k
    assert not np.array_equal(alone0["scales"], alone1["scales"])


@pytest.mark.xdist_group("torch_distributed")
def test_fsdp2_sharded_gradients_match_torchs_scaler_on_every_rank(ranks):
    """FSDP2 on a CPU gloo mesh: DTensor gradients agree over the mesh by themselves."""
    worker, results = ranks
    k = worker.POISONED
    for theirs, ours, extras in zip(
        *(_runs(results, name) for name in ("fsdp2_torch", "fsdp2_ours", "fsdp2_extras"))
    ):
        for key in ("scales", "steps", "params"):
            np.testing.assert_array_equal(ours[key], theirs[key])
        assert ours["steps"][k] == ours["steps"][k - 1]  # rank 0's shard was finite
        assert extras["steps"][k] == extras["steps"][k - 1] and int(extras["skipped"]) == 1
        assert extras["scales"][k] == extras["scales"][k - 1]  # hysteresis=2: no backoff yet
    for name in ("fsdp2_ours", "fsdp2_extras"):
        rank0, rank1 = _runs(results, name)
        np.testing.assert_array_equal(rank0["scales"], rank1["scales"])


# -- Lightning ------------------------------------------------------------------

LIGHTNING_SCALER = dict(init_scale=2.0**20, growth_interval=3)


def _lightning_fit(scaler, steps, ckpt_path=None, save_to=None):
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.precision import MixedPrecision

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return [p.detach().clone() for p in model.parameters()]


def test_lightning_gives_torchs_weights_and_its_checkpoint_restores_our_scaler(tmp_path):
    theirs_scaler = torch.amp.GradScaler("cpu", **LIGHTNING_SCALER)
    theirs = _lightning_fit(theirs_scaler, steps=16)
    ours_scaler = lt.GradScaler("cpu", **LIGHTNING_SCALER)
    ours = _lightning_fit(ours_scaler, steps=16)
    assert all(torch.equal(p, q) for p, q in zip(theirs, ours))
    assert ours_scaler.get_scale() == theirs_scaler.get_scale() < 2.0**20  # it overflowed

    # Half a run, checkpointed, then resumed with a scaler at its defaults:
    # the settings and the state come from the checkpoint. (Lightning's
    # resumed run is not the uninterrupted one, with either scaler.)
    resumed = {}
    for cls, extras in ((torch.amp.GradScaler, {}), (lt.GradScaler, dict(telemetry=True))):
        path = tmp_path / f"{cls.__module__}.ckpt"
        _lightning_fit(cls("cpu", **LIGHTNING_SCALER, **extras), 8, save_to=path)
        scaler = cls("cpu", **extras)
        resumed[cls] = scaler, _lightning_fit(scaler, steps=16, ckpt_path=path)
    (theirs_scaler, theirs), (ours_scaler, ours) = resumed.values()
    assert all(torch.equal(p, q) for p, q in zip(theirs, ours))
    state = ours_scaler.state_dict()
    assert state.pop("lossscale")["steps"] == 16  # counted on from the checkpoint's 8
    assert state == theirs_scaler.state_dict()
    assert state["growth_interval"] == LIGHTNING_SCALER["growth_interval"]


# -- Accelerate ------------------------------------------------------------------


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _accelerate_run(scaler, tmp_path=None):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.scaler = scaler  # before prepare(): the prepared optimizer takes it
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    skipped = []
    for step in range(5):
        loss = model(x).square().mean() * (float("inf") if step == 1 else 1.0)
        accelerator.backward(loss)  # scaler.scale(loss).backward()
        optimizer.step()  # scaler.step(optimizer) and scaler.update()
        optimizer.zero_grad()
        skipped.append(optimizer.step_was_skipped)
    if tmp_path is not None:
        accelerator.save_state(tmp_path)
        scaler.update(new_scale=3.0)
        accelerator.load_state(tmp_path)
    return skipped, [p.detach().clone() for p in model.parameters()]


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_steps_saves_and_loads_our_scaler_on_cpu(tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    theirs = _accelerate_run(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    scaler = lt.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    skipped, params = _accelerate_run(scaler, tmp_path)
    assert skipped == theirs[0] == [False, True, False, False, False]
    assert all(torch.equal(p, q) for p, q in zip(params, theirs[1]))
    assert scaler.get_scale() == 2.0**10  # 1024 -> 512 (skip) -> 1024, then restored from disk
