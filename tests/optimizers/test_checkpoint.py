"""`state_dict()` / `load_state_dict()` on every optimizer and the wrapper (optimizers/checkpoint.py)."""

import io
import os
import tempfile
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale as ls
from lossscale.mixed_precision import UnscaledLossWarning
from lossscale.optimizers import SGD, Adam, LossScaleOptimizer, Nadam, RMSprop
from tests.conftest import BACKENDS, Backend

SHAPES = [(3, 2), (2,)]

MAKERS = {
    "adam_ema_accumulation": lambda: Adam(0.01, use_ema=True, gradient_accumulation_steps=2),
    "loss_scaled_adam": lambda: LossScaleOptimizer(
        Adam(0.01), initial_scale=8.0, dynamic_growth_steps=2
    ),
    "nadam": lambda: Nadam(0.01),
    "rmsprop_centered": lambda: RMSprop(0.01, momentum=0.9, centered=True),
    "sgd": lambda: SGD(0.1),
}


def make_vars(backend, rng, names=("kernel", "bias")):
    return [
        ls.Variable(backend.array(rng.normal(size=s).astype(np.float32)), name=n)
        for s, n in zip(SHAPES, names)
    ]


def step(opt, backend, rng, variables, kind="f"):
    grads = [rng.normal(size=s).astype(np.float32) * 8 for s in SHAPES]
    if kind != "f":
        grads[0][0, 0] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnscaledLossWarning)
        opt.apply([backend.array(g) for g in grads], variables)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_round_trip_continues_the_trajectory(backend, name):
    rng = np.random.default_rng(0)
    variables = make_vars(backend, rng)
    opt = MAKERS[name]()
    for kind in ["f", "f", "inf", "f"]:
        step(opt, backend, rng, variables, kind)
    saved = opt.state_dict()
    twin_vars = [ls.Variable(backend.array(backend.numpy(v)), name=v.name) for v in variables]
    twin = MAKERS[name]()
    twin.build(twin_vars)
    twin.load_state_dict(saved)
    seed = rng.integers(1 << 30)
    for run, run_vars in ((opt, variables), (twin, twin_vars)):
        r = np.random.default_rng(seed)
        for kind in ["f", "inf", "f", "f", "f"]:
            step(run, backend, r, run_vars, kind)
    for a, b in zip(variables + opt.variables, twin_vars + twin.variables):
        np.testing.assert_array_equal(backend.numpy(a), backend.numpy(b))


def test_state_dict_is_a_snapshot(backend):
    rng = np.random.default_rng(1)
    variables = make_vars(backend, rng)
    opt = Adam(0.1)
    step(opt, backend, rng, variables)
    saved = opt.state_dict()
    momentum = backend.numpy(saved["state"][0]["momentum"]).copy()
    shared = {path: backend.numpy(x).copy() for path, x in saved["optimizer_variables"].items()}
    assert int(shared["adam/iteration"]) == 1
    step(opt, backend, rng, variables)
    np.testing.assert_array_equal(backend.numpy(saved["state"][0]["momentum"]), momentum)
    for path, value in saved["optimizer_variables"].items():  # the step counter too
        np.testing.assert_array_equal(backend.numpy(value), shared[path])


def test_layout_follows_torch():
    import torch

    rng = np.random.default_rng(2)
    model = torch.nn.Linear(2, 3)
    params = list(model.parameters())
    opt = LossScaleOptimizer(Adam(0.01, amsgrad=True, use_ema=True), initial_scale=4.0)
    opt.build(params)
    saved = opt.state_dict()
    assert sorted(saved) == ["optimizer_variables", "param_groups", "state"]
    assert list(saved["state"]) == [0, 1]
    assert sorted(saved["state"][1]) == ["average", "momentum", "velocity", "velocity_hat"]
    assert saved["state"][0]["momentum"].shape == params[0].shape
    assert list(saved["optimizer_variables"]) == [
        "loss_scale_optimizer/step_counter",
        "loss_scale_optimizer/dynamic_scale",
        "adam/iteration",
        "adam/learning_rate",
    ]
    group = saved["param_groups"][0]
    assert group["params"] == [0, 1] and group["initial_scale"] == 4.0
    assert "weight_decay" not in group  # the wrapper's, always at its default
    assert group["inner_optimizer"]["class_name"] == "Adam"
    assert group["inner_optimizer"]["amsgrad"] is True
    assert "learning_rate" not in group["inner_optimizer"]
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    opt.load_state_dict(loaded)
    del rng


def test_parameters_sharing_a_name_keep_their_own_slots(backend):
    rng = np.random.default_rng(3)
    variables = [
        ls.Variable(backend.array(rng.normal(size=s).astype(np.float32)))
        for s in [(2,), (2,), (3,)]
    ]  # all named "variable"
    opt = SGD(0.1, momentum=0.9)
    opt.apply(
        [
            backend.array(np.full(v.shape, float(i + 1), np.float32))
            for i, v in enumerate(variables)
        ],
        variables,
    )
    state = opt.state_dict()["state"]
    assert [float(backend.numpy(state[i]["momentum"])[0]) for i in range(3)] == pytest.approx(
        [-0.1, -0.2, -0.3]
    )


def test_slotless_optimizer_has_empty_state(backend):
    rng = np.random.default_rng(4)
    variables = make_vars(backend, rng)
    opt = SGD(0.1)
    step(opt, backend, rng, variables)
    saved = opt.state_dict()
    assert saved["state"] == {} and list(saved["optimizer_variables"]) == [
        "sgd/iteration",
        "sgd/learning_rate",
    ]


def test_load_across_backends():
    import torch

    rng = np.random.default_rng(5)
    params = [torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in SHAPES]
    opt = LossScaleOptimizer(Adam(0.01), initial_scale=8.0)
    opt.scale_loss(1.0)
    opt.apply([torch.ones(s) * 8 for s in SHAPES], params)
    twin_vars = [ls.Variable(p.numpy().copy()) for p in params]
    twin = LossScaleOptimizer(Adam(0.01), initial_scale=8.0)
    twin.build(twin_vars)
    twin.load_state_dict(opt.state_dict())
    for a, b in zip(opt.variables, twin.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert all(isinstance(v.value, np.ndarray) for v in twin.variables)


def test_unbuilt_optimizer_raises():
    with pytest.raises(
        ValueError,
        match=r"`state_dict\(\)` needs the optimizer's variables.*"
        r"Call `optimizer.build\(trainable_variables\)`",
    ):
        Adam().state_dict()
    with pytest.raises(
        ValueError,
        match=r"`load_state_dict\(\)` writes into the optimizer's "
        r"variables.*Call `optimizer.build",
    ):
        Adam().load_state_dict({})
    with pytest.raises(
        ValueError,
        match=r"^`state_variables\(\)` needs the optimizer's variables, which Adam creates when "
        r"it is built. Call `optimizer.build\(trainable_variables\)` \(or take one step\) "
        r"first.$",
    ):
        Adam().state_variables()


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_state_variables_are_state_dict_s_layout_live(backend, name):
    rng = np.random.default_rng(2)
    variables = make_vars(backend, rng)
    opt = MAKERS[name]()
    step(opt, backend, rng, variables)
    slots, shared = opt.state_variables()
    step(opt, backend, rng, variables, "inf")
    step(opt, backend, rng, variables)
    saved = opt.state_dict()  # copies, taken after the steps the live variables saw
    assert sorted(slots) == sorted(saved["state"])
    owned = {id(v) for v in opt.variables}
    for i, named in slots.items():
        assert named.keys() == saved["state"][i].keys()
        for key, variable in named.items():
            assert id(variable) in owned
            np.testing.assert_array_equal(variable.numpy(), backend.numpy(saved["state"][i][key]))
    assert shared.keys() == saved["optimizer_variables"].keys()
    for path, variable in shared.items():
        assert id(variable) in owned
        value = saved["optimizer_variables"][path]
        np.testing.assert_array_equal(variable.numpy(), backend.numpy(value))
    count = sum(len(named) for named in slots.values()) + len(shared)
    assert count == len(opt.variables)


def _saved_and_target(backend):
    rng = np.random.default_rng(6)
    variables = make_vars(backend, rng)
    opt = Adam(0.01)
    step(opt, backend, rng, variables)
    target = Adam(0.01)
    target.build(make_vars(backend, rng))
    return opt.state_dict(), target


BAD = {
    "not a dict": (
        lambda sd: [1, 2],
        r"`state_dict` must be a dict with keys \['state', "
        r"'param_groups', 'optimizer_variables'\].*Received: list",
    ),
    "missing key": (
        lambda sd: {"state": sd["state"], "param_groups": sd["param_groups"]},
        r"must be a dict with keys .*Received: \['param_groups', 'state'\]",
    ),
    "extra key": (
        lambda sd: {**sd, "scaler": {}},
        r"Received: \['optimizer_variables', "
        r"'param_groups', 'scaler', 'state'\]",
    ),
    "other params": (
        lambda sd: {**sd, "param_groups": [{"params": [0, 1, 2]}]},
        r"`state_dict\['param_groups'\]` must be one group listing the 2 "
        r"parameters .*params=\[0, \.\.\., 1\]\)\. Received: \[\{'params': "
        r"\[0, 1, 2\]\}\]",
    ),
    "two groups": (
        lambda sd: {**sd, "param_groups": sd["param_groups"] * 2},
        r"must be one group listing",
    ),
    "missing parameter": (
        lambda sd: {**sd, "state": {0: sd["state"][0]}},
        r"`state_dict\['state'\]` must have the keys \[0, 1\] of this "
        r"optimizer. Received: \[0\]",
    ),
    "unknown slot": (
        lambda sd: {**sd, "state": {0: {"exp_avg": 1}, 1: sd["state"][1]}},
        r"`state_dict\['state'\]\[0\]` must have the keys \['momentum', "
        r"'velocity'\] of this optimizer. Received: \['exp_avg'\]",
    ),
    "wrong shape": (
        lambda sd: {
            **sd,
            "state": {
                0: {**sd["state"][0], "velocity": np.zeros((2, 3), np.float32)},
                1: sd["state"][1],
            },
        },
        r"`state_dict\['state'\]\[0\]\['velocity'\]` must have the shape \(3, 2\) "
        r"of optimizer variable 'adam/kernel_velocity'. Received: shape \(2, 3\)",
    ),
    "not an array": (
        lambda sd: {
            **sd,
            "optimizer_variables": {**sd["optimizer_variables"], "adam/iteration": "three"},
        },
        r"`state_dict\['optimizer_variables'\]\['adam/iteration'\]` must be an array. "
        r"Received: str",
    ),
    "missing variable": (
        lambda sd: {**sd, "optimizer_variables": {}},
        r"`state_dict\['optimizer_variables'\]` must have the keys "
        r"\['adam/iteration', 'adam/learning_rate'\] of this optimizer",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_state_dict_raises_and_writes_nothing(backend, case):
    saved, target = _saved_and_target(backend)
    mutate, message = BAD[case]
    before = [backend.numpy(v).copy() for v in target.variables]
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(mutate(saved))
    for b, v in zip(before, target.variables):
        np.testing.assert_array_equal(b, backend.numpy(v))


def test_duplicate_paths_are_refused():
    class Twice(SGD):
        def build(self, var_list):
            super().build(var_list)
            self.add_variable((), name="extra")
            self.add_variable((), name="extra")

    opt = Twice(0.1)
    opt.build([ls.Variable(np.zeros(2, np.float32))])
    with pytest.raises(
        ValueError,
        match=r"Two variables of optimizer 'sgd' share the path "
        r"'sgd/extra'.*Give each optimizer",
    ):
        opt.state_dict()


# --- every checkpoint is a snapshot, and resumes bit for bit -----------------


def _checkpoints(opt, directory):
    """Takes the three forms of checkpoint: a variable store, a state dict, a file."""
    store = {}
    opt.save_own_variables(store)
    path = os.path.join(directory, "opt.safetensors")
    ls.saving.save(opt, path)
    return {"store": store, "state_dict": opt.state_dict(), "file": path}


def _frozen(checkpoint, backend):
    """A deep NumPy copy of a checkpoint's contents (a file's bytes), to compare later."""
    if isinstance(checkpoint, str) and checkpoint.endswith(".safetensors"):
        with open(checkpoint, "rb") as f:
            return f.read()
    if isinstance(checkpoint, dict):
        return {k: _frozen(v, backend) for k, v in checkpoint.items()}
    if isinstance(checkpoint, list):
        return [_frozen(v, backend) for v in checkpoint]
    if isinstance(checkpoint, (int, float, str, bool)) or checkpoint is None:
        return checkpoint
    return backend.numpy(checkpoint).copy()


def _assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


def _restore(kind, checkpoint, opt):
    if kind == "store":
        opt.load_own_variables(checkpoint)
    elif kind == "state_dict":
        opt.load_state_dict(checkpoint)
    else:
        ls.saving.restore(opt, checkpoint)


def _make_snapshot_optimizer():
    return LossScaleOptimizer(
        Adam(0.01, use_ema=True, gradient_accumulation_steps=2),
        initial_scale=8.0,
        dynamic_growth_steps=2,
    )


@settings(max_examples=12, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["f", "f", "f", "inf", "nan"]), min_size=2, max_size=8),
    cut=st.integers(min_value=1, max_value=7),
)
@pytest.mark.parametrize("name", BACKENDS)  # as many examples on each backend
def test_checkpoints_are_snapshots_that_resume_exactly(name, kinds, cut):
    backend = Backend(name)
    cut = min(cut, len(kinds) - 1)
    rng = np.random.default_rng(len(kinds) * 10 + cut)
    grads = []
    for kind in kinds:
        g = [rng.normal(size=s).astype(np.float32) * 8 for s in SHAPES]
        if kind != "f":
            g[1][0] = np.inf if kind == "inf" else np.nan
        grads.append(g)
    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    names = ("kernel", "bias")

    def run(opt, variables, steps):
        trail = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnscaledLossWarning)
            for g in steps:
                opt.apply([backend.array(x) for x in g], variables)
                trail.append([backend.numpy(v).copy() for v in variables + opt.variables])
        return trail

    variables = [ls.Variable(backend.array(x), name=n) for x, n in zip(init, names)]
    opt = _make_snapshot_optimizer()
    run(opt, variables, grads[:cut])
    params_at_cut = [backend.numpy(v).copy() for v in variables]
    with tempfile.TemporaryDirectory() as directory:
        checkpoints = _checkpoints(opt, directory)
        frozen = {kind: _frozen(c, backend) for kind, c in checkpoints.items()}
        expected = run(opt, variables, grads[cut:])
        for kind, checkpoint in checkpoints.items():
            _assert_same(_frozen(checkpoint, backend), frozen[kind])  # unchanged by later steps
            twin_vars = [
                ls.Variable(backend.array(x), name=n) for x, n in zip(params_at_cut, names)
            ]
            twin = _make_snapshot_optimizer()
            twin.build(twin_vars)
            _restore(kind, checkpoint, twin)
            got = run(twin, twin_vars, grads[cut:])
            for step_got, step_expected in zip(got, expected):
                for a, b in zip(step_got, step_expected):
                    np.testing.assert_array_equal(a, b, err_msg=kind)
            # Training the restored optimizer never writes into what it loaded.
            _assert_same(_frozen(checkpoint, backend), frozen[kind])


@pytest.mark.xdist_group("torch_distributed")
def test_fsdp2_state_dict_through_dcp_resumes_exactly(fsdp2_checkpoint_ranks):
    """`LossScaleOptimizer(AdamW, telemetry=True)` on a `fully_shard` model, two gloo ranks.

    Its `state_dict()` (DTensor slots, plain loss-scale state) goes through
    `dcp.save` / `dcp.load` (tests/workers/fsdp2_checkpoint_worker.py): the
    resumed run, from other initial weights, ends bit for bit where the
    uninterrupted one does, an overflow in rank 1's shard alone skipped
    before the save, with the same `summary()`.
    """
    from tests.workers import fsdp2_checkpoint_worker as worker

    for rank in fsdp2_checkpoint_ranks:
        scales = rank["wrapper/scales"]
        assert scales[worker.POISONED] == scales[worker.POISONED - 1] / 2
        assert list(rank["wrapper/resumed_scales"]) == list(scales[worker.SAVED :])
        assert rank["wrapper/same_summary"]
        for i in range(4):
            assert np.array_equal(rank[f"wrapper/param{i}"], rank[f"wrapper/resumed_param{i}"])
