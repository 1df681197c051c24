"""One bad gradient value on one shard, rank or replica only: every participant skips.

The multi-process half of `test_skip_guarantee.py`: a 4-device JAX host mesh,
two gloo ranks (ZeRO-style sharding and FSDP2, `workers/skip_guarantee_worker.py`)
and `tf.distribute.MirroredStrategy` over two logical CPUs, each in a fresh
process (device counts are fixed when the framework starts). The bad value
sits in the last device's, rank's or replica's part of one large gradient,
on both sides of the size thresholds, at its first, last and a random
element.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import workers
from tests.test_distributed import free_port, launch

SRC = str(Path(__file__).resolve().parent.parent / "src")


def run_script(script, env=None, timeout=300):
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.xdist_group("torch_distributed")
def test_two_ranks_skip_a_bad_value_on_rank_1_only(tmp_path):
    worker = Path(__file__).parent / "workers" / "skip_guarantee_worker.py"
    paths = [tmp_path / f"rank{r}.npz" for r in (0, 1)]
    proc = launch(
        workers.command(worker, tmp_path, free_port()),
        lambda: all(p.exists() for p in paths),
        cwd=workers.ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [np.load(p) for p in paths]
    for name in ("sharded", "fsdp2_wrapper", "fsdp2_torch_optimizer", "fsdp2_torch_adam"):
        flags = [r[f"{name}/unchanged"] for r in ranks]
        scales = [r[f"{name}/scales"] for r in ranks]
        # Every bad step left every rank's parameters and state bitwise as they were ...
        assert all(f.all() and f.size >= 6 for f in flags), (name, flags)
        # ... and halved the scale on both ranks alike.
        np.testing.assert_array_equal(scales[0], scales[1])
        np.testing.assert_array_equal(scales[0], 2.0**10 / 2.0 ** np.arange(scales[0].size))


JAX_MESH = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import lossscale as ls, lossscale.optax as lso, lossscale.pytree

    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = NamedSharding(mesh, P("x"))  # each device holds one row
    # Rows on both sides of the thresholds (odd, so lanes have tails).
    WIDTHS = (1023, 1025, 16385, 65537, 262145)
    rng = np.random.default_rng(0)
    init = [rng.standard_normal((4, n)).astype(np.float32) for n in WIDTHS]
    SCALE = 2.0 ** 10

    def grads_with(bad):
        grads = [rng.standard_normal((4, n)).astype(np.float32) * SCALE for n in WIDTHS]
        if bad is not None:
            i, column, value = bad
            grads[i][3, column] = value  # on the last device only
        return [jax.device_put(g, rows) for g in grads]

    cases = []
    for i, n in enumerate(WIDTHS):
        for k, column in enumerate((0, n - 1, int(rng.integers(n)))):
            cases.append((i, column, (np.nan, np.inf, -np.inf)[(i + k) % 3]))

    def wrapper():
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), initial_scale=SCALE)
        opt.build([jnp.asarray(x) for x in init])
        step = jax.jit(opt.stateless_apply)
        index = [v is opt.dynamic_scale for v in opt.variables].index(True)
        def run(state, grads):
            params, values = state
            params, values = step(values, grads, params)
            return params, values
        def scale(state):
            return float(state[1][index])
        return ([jax.device_put(x, rows) for x in init], [v.value for v in opt.variables]), run, scale

    def transformation():
        tx = lso.dynamic_loss_scale(optax.adam(1e-3), initial_scale=SCALE)
        params = [jax.device_put(x, rows) for x in init]
        @jax.jit
        def run(state, grads):
            params, opt_state = state
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state
        return (params, tx.init(params)), run, lambda state: float(lso.loss_scale(state[1]))

    def pytree():
        tx = lossscale.pytree.transform(ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), initial_scale=SCALE))
        params = [jax.device_put(x, rows) for x in init]
        apply = jax.jit(tx.apply)
        def run(state, grads):
            params, opt_state = state
            return apply(grads, opt_state, params)
        return (params, tx.init(params)), run, lambda state: float(tx.loss_scale(state[1]))

    def bits(tree):
        return [np.asarray(x).view(np.uint32) for x in jax.tree_util.tree_leaves(tree)
                if np.asarray(x).dtype == np.float32 and np.asarray(x).size > 1]

    for make in (wrapper, transformation, pytree):
        state, run, scale = make()
        state = run(state, grads_with(None))  # applied
        before, expected = bits(state), scale(state)
        for case in cases:
            state = run(state, grads_with(case))
            for p in state[0]:
                assert p.sharding == rows, p.sharding
            after = bits(state)
            assert len(after) == len(before) and all(
                np.array_equal(a, b) for a, b in zip(after, before)), (make.__name__, case)
            expected /= 2
            assert scale(state) == expected, (make.__name__, case, scale(state), expected)
        print("ok", make.__name__, len(cases))
""")


def test_a_jax_mesh_skips_a_bad_value_on_one_device():
    out = run_script(
        JAX_MESH,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"},
    )
    assert out.split().count("ok") == 3, out


TF_MIRRORED = textwrap.dedent("""
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np, tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import lossscale as ls

    SIZES = (4095, 4097, 65537, 262145)
    SCALE = 2.0 ** 10
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    clean = [rng.standard_normal(n).astype(np.float32) * SCALE for n in SIZES]
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    cases = []
    for i, n in enumerate(SIZES):
        for k, position in enumerate((0, n - 1, int(rng.integers(n)))):
            cases.append((i, position, (np.nan, np.inf, -np.inf)[(i + k) % 3]))

    # XLA refuses a step over two logical CPUs (tests/backends/tensorflow/test_replicas.py):
    # eager and traced steps.
    for compiled in (False, True):
        with strategy.scope():
            variables = [tf.Variable(w) for w in weights]
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), initial_scale=SCALE)
        opt.build(variables)

        def replica_step(index, position, value):
            # Replica 1's gradient `index` holds `value` at `position` (index -1: none).
            context = tf.distribute.get_replica_context()
            mine = tf.equal(context.replica_id_in_sync_group, 1)
            grads = []
            for i, g in enumerate(clean):
                at = tf.minimum(position, g.size - 1)  # only gradient `index`'s counts
                bad = tf.tensor_scatter_nd_update(tf.constant(g), [[at]], [value])
                grads.append(tf.where(mine & tf.equal(index, i), bad, tf.constant(g)))
            opt.apply(grads, variables)

        def step(index, position, value):
            strategy.run(replica_step, args=(index, position, value))

        if compiled:
            step = tf.function(step)

        def local(v):
            return [np.asarray(x).tobytes() for x in strategy.experimental_local_results(v)]

        step(tf.constant(-1), tf.constant(0), tf.constant(np.float32(0)))  # applied
        before = [local(v) for v in variables + opt.inner_optimizer.variables]
        expected = SCALE
        for i, position, value in cases:
            step(tf.constant(i), tf.constant(position), tf.constant(np.float32(value)))
            after = [local(v) for v in variables + opt.inner_optimizer.variables]
            for a, b in zip(after, before):
                assert a == b, (compiled, i, position)
            expected /= 2
            scales = [float(x) for x in strategy.experimental_local_results(opt.dynamic_scale.storage)]
            assert scales == [expected, expected], (compiled, i, scales, expected)
        traces = step.experimental_get_tracing_count() if compiled else 0
        print("ok", compiled, len(cases), traces)
""")


def test_mirrored_replicas_skip_a_bad_value_on_one_replica():
    out = run_script(TF_MIRRORED, timeout=600)
    lines = [line.split() for line in out.splitlines() if line.startswith("ok")]
    assert [line[1] for line in lines] == ["False", "True"], out
    assert lines[1][3] == "1", out  # traced once
