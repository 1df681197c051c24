"""backends/torch/dtensors.py: FSDP2 (`fully_shard`, DTensor parameters and gradients).

Two gloo ranks on CPU (tests/workers/fsdp2_worker.py) train the same model with each
interface: `LossScaleOptimizer` around Adam, Lion, AdamW with global-norm
clipping and a subclass of Adam that takes the per-variable `update_step`, and `lossscale.torch.Optimizer` under `lossscale.torch.GradScaler`;
in float32, and with `MixedPrecisionPolicy(param_dtype=torch.float16)`. An
inf in rank 1's shard alone makes both ranks skip, and the float32 runs end
where the same model trained unsharded in one process ends.
"""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends.torch import dtensors
from tests import workers
from tests.workers import fsdp2_worker as worker

WORKER = Path(worker.__file__)


# Session-scoped: set up once per test process, however the tests of other
# modules interleave with these in it (a module fixture is set up again then).
@pytest.fixture(scope="session")
def ranks(tmp_path_factory):
    from tests.test_distributed import free_port, launch

    out = tmp_path_factory.mktemp("fsdp2")
    proc = launch(
        workers.command(WORKER, out, free_port()),
        finished=lambda: all((out / f"rank{r}.npz").exists() for r in (0, 1)),
        cwd=workers.ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [dict(np.load(out / f"rank{r}.npz")) for r in (0, 1)]


def unsharded(name):
    """The same run in one process, on the whole batch, without FSDP."""
    model = worker.make_model()
    x, y = worker.data()

    def poison(grad, k):
        if k == worker.POISONED:
            grad.view(-1)[0] = float("inf")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scales = worker.train(name, model, x, y, poison)
    return scales, [p.detach().numpy() for p in model.parameters()]


@pytest.mark.xdist_group("torch_distributed")
@pytest.mark.parametrize("name", sorted(worker.RUNS))
def test_every_interface_trains_a_sharded_model_as_an_unsharded_one(ranks, name):
    scales, params = unsharded(name)
    k = worker.POISONED
    for result in ranks:
        got = result[f"{name}_fp32/scales"]
        np.testing.assert_array_equal(got, scales)
        assert got[k] == got[k - 1] / 2  # both ranks skipped and backed off
        for i, p in enumerate(params):
            np.testing.assert_allclose(result[f"{name}_fp32/param{i}"], p, rtol=1e-5, atol=1e-6)


@pytest.mark.xdist_group("torch_distributed")
@pytest.mark.parametrize("name", sorted(worker.RUNS))
def test_float16_parameters_skip_together(ranks, name):
    rank0, rank1 = (
        {k.split("/")[1]: v for k, v in r.items() if k.startswith(f"{name}_fp16/")} for r in ranks
    )
    for key in rank0:
        np.testing.assert_array_equal(rank0[key], rank1[key])  # one model, one decision
    k = worker.POISONED
    assert rank0["scales"][k] == rank0["scales"][k - 1] / 2
    assert all(np.isfinite(v).all() for v in rank0.values())


def test_plain_tensors_are_not_dtensors():
    assert not dtensors.is_dtensor(torch.ones(2))
    assert not dtensors.is_dtensor(np.ones(2))
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam())
    opt.build([ls.Variable(torch.ones(2))])
    assert all(not dtensors.is_dtensor(v.value) for v in opt.variables)
