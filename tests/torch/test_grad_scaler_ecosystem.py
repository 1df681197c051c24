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


# -- `_unscale_grads_` called directly (apex, some trainers) ---------------------
#
# Code in the wild calls the private `scaler._unscale_grads_(optimizer,
# inv_scale, found_inf, allow_fp16)` itself, also before any `scale()` (apex's
# and some trainers' own unscaling). Ours must then do what torch's does, bit
# for bit: the same unscaled gradients (float32 and float16, dense and sparse)
# and the same per-device overflow flags, returned as torch returns them.

DIRECT_INV_SCALE = 1.0 / 3000.0  # not a power of two: the float32 rounding shows
DIRECT_SIZES = (1, 4097, 65537)
DIRECT_INF_AT = (None, "first", "last", "random")


def _direct_gradient(layout, dtype, size, inf_at, gen):
    """A scaled gradient of `size` stored values, with an inf at `inf_at`."""
    values = torch.randn(size, generator=gen) * 1024.0
    if inf_at is not None:
        at = {"first": 0, "last": size - 1}.get(inf_at)
        if at is None:
            at = int(torch.randint(size, (), generator=gen))
        values[at] = float("inf")
    values = values.to(dtype)
    if layout == "dense":
        return torch.zeros(size, dtype=dtype), values
    # Distinct positions in a vector twice as long, unsorted: not coalesced.
    rows = torch.randperm(2 * size, generator=gen)[:size]
    grad = torch.sparse_coo_tensor(rows[None], values, (2 * size,), check_invariants=True)
    assert grad.is_coalesced() == (size == 1)
    return torch.zeros(2 * size, dtype=dtype), grad


def _direct_case(layout, dtype, size, inf_at, seed):
    """An optimizer whose gradients are the case's plus a finite one of the other dtype.

    Two param groups, so torch's grouping by device and dtype spans groups.
    """
    gen = torch.Generator().manual_seed(seed)
    param, grad = _direct_gradient(layout, dtype, size, inf_at, gen)
    other = torch.float16 if dtype == torch.float32 else torch.float32
    companion, companion_grad = _direct_gradient("dense", other, 5, None, gen)
    params = [torch.nn.Parameter(param), torch.nn.Parameter(companion)]
    params[0].grad, params[1].grad = grad, companion_grad
    opt = torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1)
    return params, opt


def _bits(t):
    """What tells two tensors apart, NaN and -0.0 included: a flat list."""
    if t.is_sparse:
        return ["sparse", t.is_coalesced(), tuple(t.shape), t._indices(), *_bits(t._values())]
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return ["dense", t.dtype, tuple(t.shape), t.contiguous().view(ints[t.element_size()])]


def _assert_same_bits(a, b):
    left, right = _bits(a), _bits(b)
    assert len(left) == len(right)
    for x, y in zip(left, right):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x, y)
        else:
            assert x == y


def _direct_scalers(stage):
    """torch's scaler and ours, fresh (`before`) or after one `scale()`."""
    extras = dict(telemetry=True, diagnostics_every=1) if stage == "after_with_extras" else {}
    theirs, ours = torch.amp.GradScaler("cpu"), lt.GradScaler("cpu", **extras)
    if stage != "before":
        for scaler in (theirs, ours):
            scaler.scale(torch.ones(()))
            assert scaler._scale is not None
    else:
        assert theirs._scale is None and ours._scale is None
    return theirs, ours


def _direct_unscale(scaler, opt, allow_fp16):
    inv_scale = torch.full((1,), DIRECT_INV_SCALE)
    found_inf = torch.zeros(1)
    found = scaler._unscale_grads_(opt, inv_scale, found_inf, allow_fp16)
    return found, found_inf


def _assert_same_found(theirs, ours):
    assert type(ours) is type(theirs) and list(ours) == list(theirs)
    for device in theirs:
        _assert_same_bits(ours[device], theirs[device])


@pytest.mark.parametrize("stage", ["before", "after", "after_with_extras"])
@pytest.mark.parametrize("inf_at", DIRECT_INF_AT)
@pytest.mark.parametrize("size", DIRECT_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("layout", ["dense", "sparse"])
def test_direct_unscale_grads_is_torchs_bit_for_bit(layout, dtype, size, inf_at, stage):
    seed = size + 10 * DIRECT_INF_AT.index(inf_at)
    theirs_scaler, ours_scaler = _direct_scalers(stage)
    theirs_params, theirs_opt = _direct_case(layout, dtype, size, inf_at, seed)
    ours_params, ours_opt = _direct_case(layout, dtype, size, inf_at, seed)
    theirs_found, theirs_arg = _direct_unscale(theirs_scaler, theirs_opt, True)
    ours_found, ours_arg = _direct_unscale(ours_scaler, ours_opt, True)

    _assert_same_found(theirs_found, ours_found)
    assert [float(f) for f in ours_found.values()] == [0.0 if inf_at is None else 1.0]
    _assert_same_bits(ours_arg, theirs_arg)  # the caller's found_inf, as torch leaves it
    for theirs_p, ours_p in zip(theirs_params, ours_params):
        _assert_same_bits(ours_p.grad, theirs_p.grad)
    # Control: the gradients were unscaled (the finite companion is no longer as made).
    companion = _direct_case(layout, dtype, size, inf_at, seed)[0][1].grad
    assert not torch.equal(ours_params[1].grad, companion)


@pytest.mark.parametrize("stage", ["before", "after", "after_with_extras"])
def test_direct_unscale_grads_of_float16_coalesces_sparse_gradients_as_torch(stage):
    """Duplicate float16 entries that overflow only once summed: torch coalesces first."""
    results = []
    for scaler in _direct_scalers(stage):
        param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
        indices = torch.tensor([[3, 1, 3]])
        values = torch.tensor([40000.0, 2.0, 40000.0], dtype=torch.float16)
        param.grad = torch.sparse_coo_tensor(indices, values, (4,), check_invariants=True)
        opt = torch.optim.SGD([param], lr=0.1)
        found, _ = _direct_unscale(scaler, opt, True)
        results.append((found, param.grad))
    (theirs_found, theirs_grad), (ours_found, ours_grad) = results
    _assert_same_found(theirs_found, ours_found)
    assert [float(f) for f in ours_found.values()] == [1.0]
    assert ours_grad.is_coalesced()  # replaced by its coalesced form, as torch does
    _assert_same_bits(ours_grad, theirs_grad)


@pytest.mark.parametrize("stage", ["before", "after"])
def test_direct_unscale_grads_without_allow_fp16_is_torchs(stage):
    """float32 gradients are unscaled; float16 ones raise torch's error, as torch's."""
    theirs_scaler, ours_scaler = _direct_scalers(stage)
    theirs_params, theirs_opt = _direct_case("dense", torch.float32, 4097, "random", 7)
    ours_params, ours_opt = _direct_case("dense", torch.float32, 4097, "random", 7)
    for opt in (theirs_opt, ours_opt):  # float32 gradients only
        opt.param_groups[1]["params"][0].grad = None
    theirs_found, _ = _direct_unscale(theirs_scaler, theirs_opt, False)
    ours_found, _ = _direct_unscale(ours_scaler, ours_opt, False)
    _assert_same_found(theirs_found, ours_found)
    _assert_same_bits(ours_params[0].grad, theirs_params[0].grad)

    messages = []
    for scaler in _direct_scalers(stage):
        params, opt = _direct_case("dense", torch.float16, 65, None, 7)
        before = [p.grad.clone() for p in params]
        with pytest.raises(ValueError) as error:
            _direct_unscale(scaler, opt, False)
        messages.append(str(error.value))
        for p, grad in zip(params, before):
            assert torch.equal(p.grad, grad)  # raised before unscaling anything
    assert messages[0] == messages[1] == "Attempting to unscale FP16 gradients."
