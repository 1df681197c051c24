"""Every process and device makes the same skip decision.

torch: two gloo ranks on localhost (in a subprocess, bounded in time).
JAX: four forced host devices (in a subprocess, since the device count is
fixed when JAX starts).
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import workers
from tests.workers import distributed_worker as worker

WORKER = Path(worker.__file__)

# Multi-process gloo jobs run one at a time (one xdist worker): concurrent
# jobs on one small machine have aborted in gloo's teardown.
pytestmark = pytest.mark.xdist_group("torch_distributed")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command, finished, attempts=2, **kwargs):
    """Runs a two-rank gloo job; a second attempt only after gloo's teardown abort.

    On this 2-core machine under load, a rank has aborted (SIGABRT,
    "terminate called without an active exception") in gloo's teardown,
    after the job had finished: gloo's worker threads can still hold work
    objects whose tensors are freed while the interpreter shuts down (the
    crash pytorch/pytorch#179291 describes; the ranks here destroy their
    process groups, and it still happens, rarely). So a run is retried only
    when a rank died of SIGABRT *and* `finished()` says every rank had
    written its results; any other failure is returned at once, and the
    retry must succeed fully.

    Args:
        command: The job's command line.
        finished: A callable: whether every rank wrote its results.
        attempts: Runs at most.
    """
    for attempt in range(attempts):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
        teardown_abort = proc.returncode != 0 and "SIGABRT" in proc.stderr and finished()
        if not teardown_abort or attempt == attempts - 1:
            return proc
    return proc


@pytest.fixture(scope="module")
def torch_ranks(tmp_path_factory):
    """`{scenario: [rank 0's results, rank 1's]}`: every worker scenario, in one two-rank job."""
    out = tmp_path_factory.mktemp("ranks")
    paths = {s: [out / f"{s}_rank{r}.npz" for r in (0, 1)] for s in worker.SCENARIOS}
    command = workers.command(WORKER, ",".join(worker.SCENARIOS), out, free_port())
    everything = [p for pair in paths.values() for p in pair]
    proc = launch(command, finished=lambda: all(p.exists() for p in everything), cwd=workers.ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {s: [dict(np.load(p)) for p in pair] for s, pair in paths.items()}


ABORTING = """
import os, signal, sys
out = sys.argv[1]
with open(os.path.join(out, "runs"), "a") as f:
    f.write("x")
if sys.argv[2] == "abort":
    print("torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated "
          "with signal SIGABRT", file=sys.stderr)
    sys.exit(1)
sys.exit(3)
"""


@pytest.mark.parametrize(
    "how,finished,runs",
    [("abort", True, 2), ("abort", False, 1), ("fail", True, 1), ("fail", False, 1)],
)
def test_launch_retries_only_an_abort_after_the_results(tmp_path, how, finished, runs):
    script = tmp_path / "job.py"
    script.write_text(ABORTING)
    proc = launch([sys.executable, str(script), str(tmp_path), how], finished=lambda: finished)
    assert proc.returncode != 0
    assert len((tmp_path / "runs").read_text()) == runs


def single_process_sharded_reference(settings=None, boost=1.0):
    import torch

    import lossscale as ls

    params = worker.initial_parameters()
    opt = ls.LossScaleOptimizer(
        ls.optimizers.Adam(0.01), initial_scale=2.0**10, dynamic_growth_steps=2, **(settings or {})
    )
    scales = []
    for grads in worker.gradient_sequence(boost):
        scale = np.float32(opt.scale_loss(1.0) if not opt.built else float(opt.dynamic_scale))
        opt.apply([torch.from_numpy(g * scale) for g in grads], params)
        scales.append(float(opt.dynamic_scale))
    return scales, [p.numpy() for p in params]


def test_sharded_gradients_skip_together(torch_ranks):
    ranks = torch_ranks["sharded"]
    scales, params = single_process_sharded_reference()
    for result in ranks:
        # The inf and the NaN were on rank 1 only, yet both ranks skipped and halved.
        np.testing.assert_array_equal(result["scales"], scales)
        assert int(result["iterations"]) == worker.STEPS - len(worker.INJECTIONS)
        for i, p in enumerate(params):
            np.testing.assert_array_equal(result[f"param{i}"], p)
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key])


def test_the_statistics_policy_decides_on_every_rank_s_measurement(torch_ranks):
    # Rank 1's peak leaves no room to grow, rank 0's does: the ranks agree on
    # the largest, as one process holding every parameter decides.
    ranks = torch_ranks["sharded_statistics"]
    scales, params = single_process_sharded_reference(worker.STATISTICS, boost=4.0)
    for result in ranks:
        np.testing.assert_array_equal(result["scales"], scales)
        for i, p in enumerate(params):
            np.testing.assert_array_equal(result[f"param{i}"], p)
    alone, _ = single_process_sharded_reference(worker.STATISTICS)
    assert scales != alone  # rank 1's gradients changed the decision


def test_without_agreement_the_ranks_drift_apart(torch_ranks):
    # Control: each rank alone in its group (no shared decision) desynchronises.
    rank0, rank1 = torch_ranks["sharded_without_agreement"]
    assert not np.array_equal(rank0["scales"], rank1["scales"])
    assert int(rank0["iterations"]) != int(rank1["iterations"])


def test_ddp_matches_a_single_process_run(torch_ranks):
    ranks = torch_ranks["ddp"]
    x, y = worker.data()
    reference = worker.train(worker.make_model(), x, y)
    assert reference["scales"][worker.STEPS // 2] == reference["scales"][2] / 2  # the poisoned step
    for result in ranks:
        np.testing.assert_array_equal(result["scales"], reference["scales"])
        assert int(result["iterations"]) == int(reference["iterations"]) == worker.STEPS - 1
        for key in reference:
            if key.startswith("param"):
                np.testing.assert_allclose(result[key], reference[key], rtol=1e-5, atol=1e-7)


def test_torch_all_max_keeps_a_nan_of_any_rank(torch_ranks):
    # gloo's MAX alone keeps or drops a rank's NaN by its position.
    results = torch_ranks["collectives"]
    for r in results:
        np.testing.assert_array_equal(r["max"], [np.nan, 1.0, np.nan, -2.0])
        assert np.isnan(r["max_scalar"]) and r["max_scalar"].shape == ()
        assert r["max_int"] == 9 and r["max_int"].dtype == np.int32
        assert list(r["all_true"]) == [False, True]


def test_process_group_on_other_backends_is_an_error():
    import lossscale as ls

    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(), process_group=object())
    opt.scale_loss(1.0)
    with pytest.raises(ValueError, match="`process_group` applies to torch.distributed only"):
        opt.apply([np.ones(2, np.float32)], [np.ones(2, np.float32)])


def test_process_group_without_torch_distributed_is_an_error():
    import torch

    import lossscale as ls

    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(), process_group=object())
    opt.scale_loss(1.0)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        opt.apply([torch.ones(2)], [torch.ones(2)])


JAX_SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import lossscale as ls

    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()), ("x",))
    shard = NamedSharding(mesh, P("x"))
    rng = np.random.default_rng(0)
    init = [rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)]

    def make():
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(0.01), initial_scale=16.0,
                                    dynamic_growth_steps=2)
        opt.build([jnp.asarray(x) for x in init])
        return opt

    sharded_opt, plain_opt = make(), make()
    step = jax.jit(sharded_opt.stateless_apply)
    plain_step = jax.jit(plain_opt.stateless_apply)
    params = [jax.device_put(x, shard) for x in init]
    plain = [jnp.asarray(x) for x in init]
    state = [v.value for v in sharded_opt.variables]
    plain_state = [v.value for v in plain_opt.variables]
    for k in range(4):
        grads = [rng.normal(size=x.shape).astype(np.float32) * 16 for x in init]
        if k == 1:
            grads[0][7, 2] = np.inf  # lives on the last device only
        sharded_grads = [jax.device_put(g, shard) for g in grads]
        before = [np.asarray(p) for p in params]
        params, state = step(state, sharded_grads, params)
        plain, plain_state = plain_step(plain_state, [jnp.asarray(g) for g in grads], plain)
        for p in params:
            assert p.sharding == shard, p.sharding
        if k == 1:  # one global skip: every shard unchanged, scale halved once
            for b, p in zip(before, params):
                np.testing.assert_array_equal(np.asarray(p), b)
            assert float(state[1]) == 8.0
        for p, q in zip(params, plain):
            np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=1e-6)
    print("ok", float(state[1]), int(state[0]))
""")


def test_jax_sharded_step_is_one_global_decision():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    out = subprocess.run(
        [sys.executable, "-c", JAX_SHARDED], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "ok"


# --- model parallelism inside `shard_map`: `axis_name` ---------------------------
# Forced JAX devices, no torch.distributed: a group of their own, so they run
# beside the torch ranks' tests, not after them.
JAX_DEVICES = pytest.mark.xdist_group("jax_shard_map")


@pytest.fixture(scope="session")
def shard_map_runs(tmp_path_factory):
    """What tests/workers/jax_shard_map_worker.py found, on 4 forced host devices."""
    from tests.workers import jax_shard_map_worker as shard_map_worker

    out = tmp_path_factory.mktemp("shard_map") / "results.json"
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        workers.command(Path(shard_map_worker.__file__), out),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=workers.ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


# The scales each option leaves (an inf at step 2, a NaN at step 4, each in
# one device's block: every device skips both).
SHARD_MAP_SCALES = {
    "default": [256, 512, 256, 256, 128, 128],
    "headroom": [256, 512, 256, 256, 128, 128],
    "hysteresis": [256, 512, 512, 512, 512, 512],  # two overflows, never in a row
    "statistics": [512, 512, 256, 256, 128, 128],  # grows at the measured step 0
    "diagnostics": [256, 512, 256, 256, 128, 128],
}


@JAX_DEVICES
@pytest.mark.parametrize("option", sorted(SHARD_MAP_SCALES))
@pytest.mark.parametrize("interface", ["optax", "wrapper"])
def test_shard_map_blocks_agree_over_axis_name(shard_map_runs, interface, option):
    """Each device's own gradient blocks, one decision: bit for bit the global-array run.

    `dynamic_loss_scale(..., axis_name="model")` and
    `LossScaleOptimizer(..., axis_name="model")` (built on the block shapes)
    inside `shard_map` with its default `check_vma=True`; parameters, every
    piece of optimizer state (telemetry's per-variable flags, the float16
    range) and optax's `summary()` equal the same steps on global arrays.
    """
    from tests.workers import jax_shard_map_worker

    assert sorted(jax_shard_map_worker.SHARD_MAP_OPTIONS) == sorted(SHARD_MAP_SCALES)
    run = shard_map_runs[f"{interface}-{option}"]
    assert run["scales"] == SHARD_MAP_SCALES[option]
    assert run["same"]
    assert run.get("same_summary", True)


@JAX_DEVICES
@pytest.mark.parametrize("option", ["default", "telemetry"])
def test_pmap_rows_agree_over_axis_name(shard_map_runs, option):
    # `dynamic_loss_scale(..., axis_name="rows")` under `jax.pmap`, an inf in
    # the last device's row at step 2: every device skips, as one decision.
    run = shard_map_runs[f"pmap-{option}"]
    assert run["same"] and run["scales"] == [512.0]  # 256, 512, 256 (skipped), 256, 512, 512


@JAX_DEVICES
@pytest.mark.parametrize("interface", ["optax", "wrapper"])
def test_shard_map_blocks_without_axis_name_are_refused_at_trace(shard_map_runs, interface):
    # Each device would decide alone: the scale would differ by device, and
    # `shard_map` refuses an output declared replicated that is not.
    assert shard_map_runs[f"{interface}-refused"] == "ValueError"


def test_all_true_and_all_max_in_one_process_return_their_input(backend):
    """Outside torch.distributed every backend has one participant: no collective."""
    from lossscale.backends import get_ops

    ops = get_ops(backend.name)
    for flag in (True, False):
        assert bool(backend.numpy(ops.all_true(backend.array(np.bool_(flag))))) is flag
    assert float(backend.numpy(ops.all_max(backend.array(np.float32(2.5))))) == 2.5
    message = (
        "torch.distributed is not initialised"
        if backend.name == "torch"
        else "`process_group` applies to torch.distributed only"
    )
    for primitive in (ops.all_true, ops.all_max):
        with pytest.raises(ValueError, match=message):
            primitive(backend.array(np.bool_(True)), object())


def test_agreement_every_raises_on_both_ranks_naming_what_drifted(torch_ranks):
    # Rank 1's state was changed after step 0; `agreement_every=2` checks after step 1.
    expected = {
        "loss_scale_optimizer": "`scale` is 1024 on ranks [1], 32768 on ranks [0]",
        "grad_scaler": "`scale` is 128 on ranks [1], 65536 on ranks [0]",
        "torch_optimizer": "`param_groups[0] lr` is 0.05 on ranks [1], 0.1 on ranks [0]",
    }
    for front_end, named in expected.items():
        for rank in (0, 1):
            first, second = torch_ranks["agreement"][rank][front_end]
            assert first == "", (front_end, rank)
            assert second.startswith("The ranks' "), (front_end, rank, second)
            assert "drifted apart by step 1: " in second and named in second, (front_end, second)
