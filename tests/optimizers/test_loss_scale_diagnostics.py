"""optimizers/loss_scale_diagnostics.py: what `LossScaleOptimizer` records about its steps.

The loss's own flag (`scale_loss`: a scalar, a loss per example, a traced
loss), `snapshot()`, step observers and their handles, and the cadence of
the float16-range measurement: counted on the host where Python runs every
step (no device read), decided on the device under `torch.compile`. The
measurement itself is tested in tests/mixed_precision/test_diagnostics.py,
whose model this file shares.
"""

import numpy as np
import pytest

import lossscale as ls
from tests.conftest import BACKENDS, Backend
from tests.mixed_precision.test_diagnostics import SHAPES, build, scaled_grads


def test_a_traced_loss_is_not_recorded():
    # Inside `jax.grad` the loss is a tracer, which no variable may keep.
    import jax
    import jax.numpy as jnp

    variables, opt = build(Backend("jax"), telemetry=True)
    jax.grad(lambda w: opt.scale_loss(jnp.sum(w)))(jnp.ones(3))
    assert int(opt._state["loss_finite"].value) == -1


@pytest.mark.parametrize("name", BACKENDS)
def test_snapshot_is_a_copy_later_steps_leave_alone(name):
    backend = Backend(name)
    variables, opt = build(backend, telemetry=True)
    opt.scale_loss(1.0)
    rng = np.random.default_rng(6)
    first = opt.snapshot()
    with np.errstate(invalid="ignore"):  # 0 * inf: NaN among the infs, on purpose
        bad = [g * np.inf for g in scaled_grads(rng, 1.0)]
    opt.apply([backend.array(g) for g in bad], variables)
    assert first["dynamic_scale"] == 2.0**10 and first["overflows"] == []
    assert opt.snapshot()["dynamic_scale"] == 2.0**9


class Recorder:
    """An observer: the steps it was told of, and a module for each overflow."""

    def __init__(self):
        self.calls = []

    def on_step(self, finite, step):
        self.calls.append((finite, step))

    def modules_at(self, steps):
        return {s: f"block{s}" for s in steps}


def test_observers_hear_every_step_and_name_the_module():
    backend = Backend("numpy")
    variables, opt = build(backend, telemetry=True)
    recorder = Recorder()
    handle = opt.register_step_observer(recorder)
    rng = np.random.default_rng(7)
    opt.scale_loss(1.0)
    for bad in (False, True):
        grads = scaled_grads(rng, float(opt.dynamic_scale))
        grads[0][0, 0] = np.inf if bad else grads[0][0, 0]
        opt.apply([backend.array(g) for g in grads], variables)
    assert [(bool(f), int(s)) for f, s in recorder.calls] == [(True, 0), (False, 1)]
    assert opt.summary()["overflows"][0]["module"] == "block1"
    handle.remove()
    opt.apply([backend.array(g) for g in scaled_grads(rng, 1.0)], variables)
    assert len(recorder.calls) == 2
    assert opt.summary()["overflows"][0]["module"] is None


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_starts_without_the_observers(how):
    """An observer is bound to a model: a copy does not call it, the original still does."""
    import copy
    import pickle

    backend = Backend("numpy")
    variables, opt = build(backend, telemetry=True)
    recorder = Recorder()
    opt.register_step_observer(recorder)
    copied_vars, copied = (
        copy.deepcopy((variables, opt))
        if how == "deepcopy"
        else pickle.loads(pickle.dumps((variables, opt)))
    )
    rng = np.random.default_rng(3)
    copied.scale_loss(1.0)
    copied.apply([backend.array(g) for g in scaled_grads(rng, 1.0)], copied_vars)
    assert recorder.calls == [] and copied._observers == []
    opt.scale_loss(1.0)
    opt.apply([backend.array(g) for g in scaled_grads(rng, 1.0)], variables)
    assert len(recorder.calls) == 1


def test_no_host_read_in_a_torch_step_with_diagnostics_and_telemetry():
    import torch

    from tests.torch_cases import count_ops

    def reads(**settings):
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), initial_scale=1024.0, **settings)
        opt.build(params)
        counts = []
        for _ in range(3):  # the first step is measured
            grads = [torch.randn(s) * 1024 for s in SHAPES]
            with count_ops() as seen:
                opt.scale_loss(torch.tensor(1.0))
                opt.apply(grads, params)
            counts.append(seen.count("aten._local_scalar_dense.default"))
        return counts

    # The CPU scale read by the fused Adam step (tests/optimizers/test_loss_scale_step.py),
    # and nothing more: the cadence is counted on the host.
    reads()  # the process's one-time checks of the host arithmetic (backends/torch/host.py)
    plain = reads()
    assert reads(diagnostics_every=2) == plain
    assert reads(diagnostics_every=1, telemetry=True) == reads(telemetry=True)


def test_a_compiled_torch_step_decides_on_the_device_and_never_recompiles():
    # A host count would be a guard of the compiled step, which changes
    # every step: under torch.compile the cadence is the device's.
    import torch

    torch.compiler.reset()
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    eager = [torch.nn.Parameter(p.detach().clone()) for p in params]
    settings = dict(initial_scale=8.0, diagnostics_every=2, telemetry=True)
    compiled_opt = ls.LossScaleOptimizer(ls.optimizers.SGD(1e-3), **settings)
    eager_opt = ls.LossScaleOptimizer(ls.optimizers.SGD(1e-3), **settings)
    for opt, ps in ((compiled_opt, params), (eager_opt, eager)):
        opt.scale_loss(1.0)
        opt.build(ps)
    step = torch.compile(lambda g: compiled_opt.apply(g, params), fullgraph=True, backend="eager")
    rng = np.random.default_rng(9)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(5):
            grads = [torch.from_numpy(g) for g in scaled_grads(rng, 8.0)]
            step([g.clone() for g in grads])
            eager_opt.apply([g.clone() for g in grads], eager)
    torch.compiler.reset()
    assert compiled_opt.summary() == eager_opt.summary()
    assert compiled_opt.summary()["float16_range_step"] == 4


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("where", ["first", "last", "random", "none"])
def test_a_loss_per_example_is_finite_only_if_every_entry_is(name, where):
    backend = Backend(name)
    _, opt = build(backend, telemetry=True)
    losses = np.random.default_rng(11).standard_normal(257).astype(np.float32)
    index = {"first": 0, "last": 256, "random": 93, "none": None}[where]
    if index is not None:
        losses[index] = np.nan if where == "random" else np.inf
    opt.scale_loss(backend.array(losses))
    assert int(backend.numpy(opt._state["loss_finite"])) == (index is None)
    opt.scale_loss(backend.array(np.float32(2.0)))  # a scalar
    assert int(backend.numpy(opt._state["loss_finite"])) == 1


@pytest.mark.parametrize("name", ["numpy", "torch"])
@pytest.mark.parametrize("loss", [1.5, float("nan"), float("-inf")])
def test_a_python_number_loss_is_flagged_on_the_host(name, loss):
    _, opt = build(Backend(name), telemetry=True)
    opt.scale_loss(loss)
    assert int(opt._state["loss_finite"].value) == int(np.isfinite(loss))


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_observers_keep_each_step_s_index_though_the_state_is_written_in_place(name):
    backend = Backend(name)
    variables, opt = build(backend, telemetry=True)
    first, second = Recorder(), Recorder()
    handle = opt.register_step_observer(first)
    opt.register_step_observer(second)
    rng = np.random.default_rng(12)
    opt.scale_loss(1.0)
    for _ in range(3):
        opt.apply([backend.array(g) for g in scaled_grads(rng, 1.0)], variables)
    assert [int(backend.numpy(s)) for _, s in first.calls] == [0, 1, 2]
    handle.remove()
    handle.remove()  # a second time: nothing, and the other observer stays
    opt.apply([backend.array(g) for g in scaled_grads(rng, 1.0)], variables)
    assert len(first.calls) == 3 and len(second.calls) == 4
    assert [int(backend.numpy(s)) for _, s in second.calls] == [0, 1, 2, 3]


# --- resuming: the measuring steps are the uninterrupted run's -----------------
def _statistics_run(make_params, load=None, split=3, steps=7):
    """Seven steps of the statistics policy (measuring every 2nd); `load` resumes at `split`.

    `load(opt, fresh, params)` moves the state of `opt` into `fresh`, built on
    `params`. Returns the scales and the last measured step.
    """
    import torch

    def make():
        return ls.LossScaleOptimizer(
            torch.optim.Adam(params, lr=0.01) if torch_native else ls.optimizers.Adam(0.01),
            initial_scale=256.0,
            dynamic_growth_steps=1,
            growth_policy="statistics",
            diagnostics_every=2,
            telemetry=True,
        )

    rng = np.random.default_rng(0)
    params, torch_native = make_params()
    opt = make()
    opt.scale_loss(1.0)
    scales = []
    for k in range(steps):
        if load is not None and k == split:
            params, _ = make_params(
                [np.asarray(p.detach() if torch_native else p.numpy()) for p in params]
            )
            fresh = make()
            load(opt, fresh, params)
            opt = fresh
            opt.scale_loss(1.0)
        # Large gradients every third step: no room to grow there.
        size = 20.0 if k % 3 == 0 else 0.01
        grads = [rng.normal(size=64).astype(np.float32) * size * float(opt.dynamic_scale)]
        if torch_native:
            grads = [torch.from_numpy(g) for g in grads]
        opt.apply(grads, params)
        scales.append(float(opt.dynamic_scale))
    return scales, opt.summary()["float16_range_step"]


def _numpy_params(values=None):
    values = values or [np.ones(64, np.float32)]
    return [ls.Variable(v.copy(), name="w") for v in values], False


def _torch_params(values=None):
    import torch

    values = values or [np.ones(64, np.float32)]
    return [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in values], True


def _by_state_dict(opt, fresh, params):
    if not getattr(fresh.inner_optimizer, "keeps_native_state", False):
        fresh.build(params)  # a torch optimizer's wrapper loads unbuilt
    fresh.load_state_dict(opt.state_dict())


def _by_store(opt, fresh, params):
    store = {}
    opt.save_own_variables(store)
    fresh.build(params)
    fresh.load_own_variables(store)


def _by_weights(opt, fresh, params):
    fresh.build(params)
    fresh.set_weights([v.numpy() for v in opt.variables])


def _by_file(opt, fresh, params):
    import tempfile

    from lossscale import saving

    with tempfile.TemporaryDirectory() as folder:
        saving.save(opt, f"{folder}/opt.lossscale")
        fresh.build(params)
        saving.restore(fresh, f"{folder}/opt.lossscale")


@pytest.mark.parametrize(
    "make_params, load",
    [
        (_numpy_params, _by_state_dict),
        (_numpy_params, _by_store),
        (_numpy_params, _by_weights),
        (_numpy_params, _by_file),
        (_torch_params, _by_state_dict),  # the native optimizer's state dict
    ],
    ids=["state_dict", "own_variables", "set_weights", "saving", "torch_native"],
)
def test_a_resumed_run_measures_on_the_uninterrupted_run_s_steps(make_params, load):
    uninterrupted = _statistics_run(make_params)
    assert _statistics_run(make_params, load) == uninterrupted
    assert uninterrupted[1] == 6


def test_a_jitted_jax_step_reserves_no_copy_of_the_gradients_for_diagnostics():
    """XLA reserves the measurement branch's memory on every step, taken or not.

    `large`'s 16 gradients of 1M elements: with `diagnostics_every` the
    jitted `stateless_apply` reserves at most the measurement's packed
    elements more (`backends/jax/float16_range.py`), where packing every
    gradient reserved 69 MiB, a float32 copy of them all and the rows'
    counts.
    """
    import jax

    from lossscale.backends.jax import float16_range
    from lossscale.bench import frameworks, workloads

    params, grads = frameworks.jax_arrays(jax, workloads.get("large"))

    def reserved(every):
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), diagnostics_every=every)
        opt.build(params)
        step = jax.jit(lambda p, v, g: opt.stateless_apply(v, g, p), donate_argnums=(0, 1))
        values = [v.value for v in opt.variables]
        return step.lower(params, values, grads).compile().memory_analysis().temp_size_in_bytes

    assert reserved(100) - reserved(None) <= 4 * float16_range.PACK_CAPACITY * 1.2


def _arrays_larger_than(hlo, elements):
    """`(operation, shape)` of each array over `elements` that XLA's optimized HLO writes out.

    Only the instructions of unfused computations make buffers (a fusion's
    inside does not); parameters, views (`bitcast`) and a loop's reads of
    its own state (`get-tuple-element`) are left out.
    """
    import re

    found, fused = [], False
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) ", line)
        if header:  # a computation starts at the line's first column
            fused = "fused" in header.group(1) or header.group(1).startswith("wrapped_")
            continue
        match = re.match(r"\s*(?:ROOT )?\S+ = (\w+\[[\d,]*\])\{[^}]*\} (\S+)\(", line)
        if fused or match is None:
            continue
        shape, operation = match.groups()
        if operation in ("parameter", "bitcast", "get-tuple-element"):
            continue
        if np.prod([int(d) for d in re.findall(r"\d+", shape.split("[")[1])]) > elements:
            found.append((operation, shape))
    return sorted(found)


def test_an_xla_compiled_tensorflow_step_writes_out_no_gradient_sized_array_for_diagnostics():
    """Under `tf.function(jit_compile=True)` the measurement adds no array larger than a chunk.

    Measured whole, each of its comparisons was an int32 array of the
    largest gradient's size, which XLA reserves in the branch on every
    step; now a gradient of more than `CHUNK` (1M) elements is read a chunk
    at a time (`backends/tensorflow/float16_range.py`). The step with
    diagnostics writes out the same large arrays as the step without (the
    update's own).
    """
    import tensorflow as tf

    from lossscale.backends.tensorflow import float16_range

    shapes = [(3 * float16_range.CHUNK + 5,), (1500, 1001), (64,)]

    def large_arrays(every):
        variables = [tf.Variable(tf.zeros(s)) for s in shapes]
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), diagnostics_every=every)
        opt.build(variables)

        @tf.function(jit_compile=True)
        def step(*grads):
            opt.scale_loss(1.0)
            opt.apply(list(grads), variables)

        specs = [tf.TensorSpec(s, tf.float32) for s in shapes]
        hlo = step.experimental_get_compiler_ir(*specs)(stage="optimized_hlo")
        return _arrays_larger_than(hlo, float16_range.CHUNK)

    without = large_arrays(None)
    assert without  # the update's own arrays are seen
    assert large_arrays(100) == without
