"""FSDP2 with every `LossScalePolicy` option, on each interface (tests/workers/fsdp2_options_worker.py).

Two gloo ranks on CPU train a model sharded with `fully_shard`; at step
`POISONED` an inf sits in rank 1's shard alone. With each option every rank
must take the same decision (the same scales, the same skipped step, a
`LossScaleError` at the same step) and report the same summary, for
`LossScaleOptimizer`, `lossscale.torch.Optimizer` under our `GradScaler`
and a torch optimizer under our `GradScaler`.
"""

import ast
from pathlib import Path

import numpy as np
import pytest

from tests import workers
from tests.workers import fsdp2_options_worker as worker

WORKER = Path(worker.__file__)
K = worker.POISONED

# Per option: the scales each step leaves, and the step that raises (-1: none).
EXPECTED = {
    "telemetry": ([64, 128, 128, 64, 64, 128], -1),
    "headroom": ([64, 128, 128, 64, 64, 128], -1),  # small gradients: growth allowed
    "hysteresis": ([64, 128, 128, 128, 128, 256], -1),  # skipped without a backoff
    "max_consecutive_skips": ([64, 128, 128], K),
    "min_scale": ([64, 96, 96], K),
    # Grows every measured step while the peak leaves room, not only every 2.
    "statistics": ([128, 256, 512, 256, 512, 1024], -1),
}


# Session-scoped: set up once per test process, however the tests of other
# modules interleave with these in it (a module fixture is set up again then).
@pytest.fixture(scope="session")
def ranks(tmp_path_factory):
    from tests.test_distributed import free_port, launch

    out = tmp_path_factory.mktemp("fsdp2_options")
    proc = launch(
        workers.command(WORKER, out, free_port()),
        finished=lambda: all((out / f"rank{r}.npz").exists() for r in (0, 1)),
        cwd=workers.ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [dict(np.load(out / f"rank{r}.npz")) for r in (0, 1)]


def test_every_option_is_run_on_every_interface():
    assert sorted(EXPECTED) == sorted(worker.OPTIONS)
    assert len(worker.RUNS) == 3 * len(worker.OPTIONS)


@pytest.mark.xdist_group("torch_distributed")
@pytest.mark.parametrize("interface", sorted(worker.INTERFACES))
@pytest.mark.parametrize("option", sorted(worker.OPTIONS))
def test_every_rank_takes_the_same_decision_and_reports_the_same_summary(ranks, interface, option):
    key = f"{interface}-{option}"
    mine = {name: value for name, value in ranks[0].items() if name.startswith(key + "/")}
    assert len(mine) > 3, sorted(ranks[0])
    for name, value in mine.items():
        assert np.array_equal(value, ranks[1][name]), name
    scales, raised = EXPECTED[option]
    assert ranks[0][f"{key}/scales"].tolist() == scales
    assert int(ranks[0][f"{key}/raised"]) == raised
    summary = ast.literal_eval(str(ranks[0][f"{key}/summary"]))
    # Every option here records the counters: the one skipped step, the
    # poisoned one, and (for the limits) the failing step not counted twice.
    assert summary["skipped_steps"] == 1 and summary["last_overflow_step"] == K, summary
    assert summary["steps"] == (K + 1 if raised == K else worker.STEPS), summary
    if interface == "loss_scale_optimizer":
        assert summary["nonfinite_variables"] == ["param_0"], summary
