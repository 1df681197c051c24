"""`TorchAdapter`: torch.optim optimizers driven by lossscale and `LossScaleOptimizer`.

Wrapped in a `LossScaleOptimizer` with injected inf/NaN gradients, the
parameters and the native state follow, bit for bit, a twin native
optimizer stepped directly on the unscaled gradients of the steps that were
not skipped. Scales are powers of two, so unscaling is exact.
"""

import copy
import doctest
import io
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.torch import TorchAdapter
from lossscale.torch import adapter as torch_adapter
from tests.torch_cases import no_host_reads

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


SHAPES = [(4, 3), (5,), (2, 2)]


STEPS = 10


# The first step overflows (a fused SGD's momentum buffers do not exist
# yet), then inf and NaN later; growth every 2 finite steps.
BAD_STEPS = {0: np.inf, 4: np.nan, 7: -np.inf}


INITIAL_SCALE, GROWTH_STEPS = 16.0, 2


NATIVE = {
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_momentum_fused": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, dampening=0.5, fused=True
    ),
    "adagrad_fused": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
}


FUSED = {name for name in NATIVE if name.endswith("_fused")}


def make_params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]


def make_grads(seed=1):
    """Unscaled gradients per step; `None` where the step overflows."""
    generator = torch.Generator().manual_seed(seed)
    return [
        None if step in BAD_STEPS else [torch.randn(s, generator=generator) for s in SHAPES]
        for step in range(STEPS)
    ]


def scaled(grads, step, scale):
    """What `backward()` of a scaled loss gives: finite grads times the scale, or an overflow."""
    if grads is None:
        out = [torch.ones(s) for s in SHAPES]
        out[1][2] = BAD_STEPS[step]
        return out
    return [g * scale for g in grads]


def wrapped(name, params, **kwargs):
    native = NATIVE[name](params)
    opt = ls.LossScaleOptimizer(
        TorchAdapter(native, **kwargs),
        initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS,
    )
    return opt, native


def state_tensors(native):
    return [
        (i, key, value)
        for i, entry in native.state_dict()["state"].items()
        for key, value in sorted(entry.items())
    ]


def assert_same_state(native, twin):
    """Equal native states; a fused kernel skipping the very first step (found_inf)
    has made its state already, at its initial value (zeros), where the twin has none."""
    theirs = {(i, k): v for i, k, v in state_tensors(twin)}
    for i, key, value in state_tensors(native):
        expected = theirs.pop((i, key), torch.zeros_like(value))
        assert torch.equal(value, expected), key
    assert not theirs


# --- the trajectory -----------------------------------------------------------
@pytest.mark.parametrize("name", sorted(NATIVE))
def test_trajectory_equals_native_without_skipped_steps(name):
    params, twin_params = make_params(), make_params()
    opt, native = wrapped(name, params)
    twin = NATIVE[name](twin_params)
    taken = 0
    for step, grads in enumerate(make_grads()):
        scale = opt.scale_loss(torch.tensor(1.0))
        opt.apply(scaled(grads, step, scale), params)
        if grads is not None:
            for p, g in zip(twin_params, grads):
                p.grad = g
            twin.step()
            taken += 1
        for p, q in zip(params, twin_params):
            assert torch.equal(p, q), (name, step)
        assert_same_state(native, twin)
    assert int(opt.iterations) == taken == STEPS - len(BAD_STEPS)
    # 16, overflow -> 8, two finite -> 16, overflow -> 8, ... and two finite steps at the end.
    assert float(opt.dynamic_scale) == 16.0


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_optimizers_skip_without_host_reads(name):
    params = make_params()
    opt, _ = wrapped(name, params)
    grads = make_grads()
    opt.apply(scaled(grads[1], 1, INITIAL_SCALE), params)  # every state buffer exists now
    seen = []
    native_step = opt.inner_optimizer.optimizer.step

    def spy():
        seen.append(opt.inner_optimizer.optimizer.found_inf)
        native_step()

    opt.inner_optimizer.optimizer.step = spy
    with no_host_reads():
        for step in (2, 4, 5):
            opt.apply(scaled(grads[step], step, opt.scale_loss(torch.tensor(1.0))), params)
    assert [float(x) for x in seen] == [0.0, 1.0, 0.0]
    assert not hasattr(opt.inner_optimizer.optimizer, "found_inf")


@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_other_optimizers_read_the_mask_once_and_skip_the_step(name):
    params = make_params()
    opt, native = wrapped(name, params)
    calls = []
    native_step = native.step
    native.step = lambda: (calls.append(1), native_step())
    reads = []
    real_bool = torch.Tensor.__bool__
    torch.Tensor.__bool__ = lambda self: (reads.append(1), real_bool(self))[1]
    try:
        grads = make_grads()
        for step in (1, 0, 2):  # finite, overflow, finite
            opt.apply(scaled(grads[step], step, opt.scale_loss(torch.tensor(1.0))), params)
    finally:
        torch.Tensor.__bool__ = real_bool
    assert len(calls) == 2 and len(reads) == 3


def test_fused_sgd_first_step_overflow_leaves_no_uninitialised_buffer():
    # torch's fused SGD alone stores `empty_like` buffers when found_inf
    # skips its first step; the adapter reads the mask on the host then.
    params = make_params()
    opt, native = wrapped("sgd_momentum_fused", params)
    opt.apply(scaled(None, 0, INITIAL_SCALE), params)
    assert len(native.state) == 0


def test_apply_without_wrapper_steps_the_native_optimizer():
    params, twin_params = make_params(), make_params()
    opt = TorchAdapter(torch.optim.Adam(params, lr=0.01))
    twin = torch.optim.Adam(twin_params, lr=0.01)
    for grads in filter(None, make_grads()):
        opt.apply(grads, params)
        for p, g in zip(twin_params, grads):
            p.grad = g
        twin.step()
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    assert int(opt.iterations) == STEPS - len(BAD_STEPS)


def test_own_grads_are_restored_and_missing_grads_skip_the_parameter():
    params = make_params()
    before = [p.detach().clone() for p in params]
    mine = torch.full(SHAPES[0], 7.0)
    params[0].grad = mine
    opt = TorchAdapter(torch.optim.SGD(params, lr=0.5))
    grads = make_grads()[1]
    with pytest.warns(UserWarning, match=r"Gradients do not exist for variables \['param_0'\]"):
        opt.apply([None, grads[1], grads[2]], params)
    assert params[0].grad is mine and params[1].grad is None
    assert torch.equal(params[0], before[0])
    assert torch.equal(params[1], before[1] - 0.5 * grads[1])


def test_half_parameters_receive_gradients_in_their_dtype():
    params = [torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float16))]
    opt = ls.LossScaleOptimizer(TorchAdapter(torch.optim.SGD(params, lr=0.5)), initial_scale=1024.0)
    opt.apply([torch.tensor([1024.0, 2048.0], dtype=torch.float16)], params)
    assert params[0].dtype == torch.float16
    assert params[0].detach().tolist() == [0.5, -3.0]


@pytest.mark.parametrize(
    "option, value, expected",
    [
        (
            "global_clipnorm",
            1.0,
            lambda g: [x * min(1.0, 1.0 / np.sqrt(sum((y**2).sum() for y in g))) for x in g],
        ),
        ("clipnorm", 0.5, lambda g: [x * 0.5 / max(np.sqrt((x**2).sum()), 0.5) for x in g]),
        ("clipvalue", 0.3, lambda g: [np.clip(x, -0.3, 0.3) for x in g]),
    ],
)
def test_clipping_acts_on_unscaled_gradients(option, value, expected):
    params = make_params()
    start = [p.detach().numpy().astype(np.float64) for p in params]
    opt, _ = wrapped("sgd_momentum", params, **{option: value})
    opt.inner_optimizer.optimizer.param_groups[0]["momentum"] = 0.0
    opt.inner_optimizer.optimizer.param_groups[0]["nesterov"] = False
    grads = [g * 3 for g in make_grads()[1]]
    opt.apply(scaled(grads, 1, INITIAL_SCALE), params)
    g64 = [g.numpy().astype(np.float64) for g in grads]
    for p, s, c in zip(params, start, expected(g64)):
        np.testing.assert_allclose(p.detach().numpy(), s - 0.1 * c, rtol=1e-5, atol=1e-6)


# --- learning rate ------------------------------------------------------------
def test_learning_rate_reads_and_writes_every_param_group():
    params = make_params()
    native = torch.optim.Adam([{"params": params[:1]}, {"params": params[1:], "lr": 0.01}], lr=0.01)
    opt = ls.LossScaleOptimizer(TorchAdapter(native))
    assert opt.learning_rate == 0.01 and isinstance(opt.learning_rate, float)
    opt.learning_rate = 0.5
    assert [g["lr"] for g in native.param_groups] == [0.5, 0.5]
    scheduler = torch.optim.lr_scheduler.StepLR(native, step_size=1, gamma=0.5)
    native.step()
    scheduler.step()
    assert opt.learning_rate == 0.25


def test_tensor_learning_rate_is_written_in_place():
    params = make_params()
    rate = torch.tensor(0.01)
    opt = TorchAdapter(torch.optim.Adam(params, lr=rate, fused=True))
    opt.learning_rate = 0.125
    assert opt.optimizer.param_groups[0]["lr"] is rate and float(rate) == 0.125
    assert opt.learning_rate == 0.125


def test_learning_rate_errors():
    params = make_params()
    native = torch.optim.SGD([{"params": params[:1], "lr": 0.1}, {"params": params[1:]}], lr=0.2)
    opt = TorchAdapter(native)
    assert getattr(opt, "learning_rate", None) is None
    with pytest.raises(
        AttributeError,
        match=r"different learning rates \(\[0\.1, 0\.2\]\).*"
        r"param_groups\[i\]\['lr'\]",
    ):
        _ = opt.learning_rate
    with pytest.raises(TypeError, match="torch.optim.lr_scheduler.*Received: learning_rate="):
        opt.learning_rate = ls.schedules.ExponentialDecay(0.1, 10, 0.5)
    with pytest.raises(TypeError, match="param_groups"):
        opt.learning_rate = lambda: 0.1
    with pytest.raises(
        ValueError,
        match=r"`learning_rate` must be a finite number >= 0\. "
        r"Received: learning_rate=-1\.0",
    ):
        opt.learning_rate = -1.0
    assert [g["lr"] for g in native.param_groups] == [0.1, 0.2]


# --- state ---------------------------------------------------------------------
def run(opt, params, steps):
    grads = make_grads()
    for step in steps:
        opt.apply(scaled(grads[step], step, opt.scale_loss(torch.tensor(1.0))), params)


def test_variables_hold_the_step_counter_only():
    params = make_params()
    opt, _ = wrapped("adam", params)
    run(opt, params, [1])
    assert [v.path for v in opt.inner_optimizer.variables] == ["torch_optimizer/iteration"]
    assert [v.path for v in opt.variables][-1] == "torch_optimizer/iteration"
    assert opt.inner_optimizer.iterations.backend == "torch"


# --- what cannot work raises ---------------------------------------------------
def test_unsupported_methods_raise():
    params = make_params()
    opt, _ = wrapped("adam", params)
    run(opt, params, [1])
    inner = opt.inner_optimizer
    values = [v.value for v in opt.variables]
    grads = make_grads()[2]
    with pytest.raises(NotImplementedError, match="does not support stateless application"):
        inner.stateless_apply([v.value for v in inner.variables], grads, params)
    with pytest.raises(NotImplementedError, match="does not support stateless application"):
        opt.stateless_apply(values, [g * 8 for g in grads], [p.detach() for p in params])
    for method in ("save_own_variables", "load_own_variables"):
        with pytest.raises(
            NotImplementedError,
            match=rf"`{method}`: the wrapped Adam keeps its state in "
            r"`optimizer.state`.*`state_dict\(\)`",
        ):
            getattr(inner, method)({})
    for target in (inner, opt):
        with pytest.raises(
            NotImplementedError, match=r"cannot be serialized: it wraps a live Adam"
        ):
            target.get_config()
    with pytest.raises(NotImplementedError, match="param group with weight_decay=0"):
        inner.exclude_from_weight_decay(var_names=["bias"])


def test_construction_and_build_errors():
    with pytest.raises(
        ValueError,
        match=r"`optimizer` must be a torch.optim.Optimizer instance"
        r".*Received: optimizer='adam'",
    ):
        TorchAdapter("adam")
    with pytest.raises(
        ValueError,
        match=r"Argument\(s\) not recognized by TorchAdapter: "
        r"\['use_ema', 'weight_decay'\]\. Accepted: optimizer, "
        r"name, clipnorm, clipvalue, global_clipnorm\. Set other "
        r"settings on the native optimizer",
    ):
        TorchAdapter(torch.optim.SGD(make_params(), lr=0.1), weight_decay=0.1, use_ema=True)
    with pytest.raises(ValueError, match="Only one of `clipnorm`"):
        TorchAdapter(torch.optim.SGD(make_params(), lr=0.1), clipnorm=1.0, clipvalue=1.0)
    params = make_params()
    cases = [
        (
            [p.detach().clone() for p in params],
            r"exactly the parameters of the wrapped SGD \(matched by tensor identity.*Received: 3 "
            r"variable\(s\) that are not its parameters \['param_0', 'param_1', 'param_2'\], and 3 "
            r"of its parameters missing \(shapes \[\(4, 3\), \(5,\), \(2, 2\)\]\)",
        ),
        (
            params[:2],
            r"Received: 0 variable\(s\).*1 of its parameters missing \(shapes \[\(2, 2\)\]",
        ),
        (params + [params[0]], r"lists the parameter behind 'param_0' twice"),
        (
            [p.detach().numpy() for p in params],
            r"works on torch tensors\. Received: var_list of numpy arrays",
        ),
    ]
    for var_list, message in cases:
        opt = TorchAdapter(torch.optim.SGD(params, lr=0.1))
        with pytest.raises(ValueError, match=message):
            opt.build(var_list)
        assert not opt.built and opt.variables[0].backend == "torch"


def test_parameters_may_come_in_any_order():
    params = make_params()
    opt = TorchAdapter(torch.optim.SGD(params, lr=0.5))
    grads = make_grads()[1]
    before = [p.detach().clone() for p in params]
    opt.apply(grads[::-1], params[::-1])
    for p, b, g in zip(params, before, grads):
        assert torch.equal(p, b - 0.5 * g)


# --- packaging -----------------------------------------------------------------
def test_docstring_example():
    result = doctest.testmod(torch_adapter, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_importing_the_adapter_imports_no_framework():
    code = (
        "import sys, lossscale.optimizers.native; "
        "print(sorted(m for m in ('torch', 'jax', 'optax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_warning_from_a_clean_step():
    params = make_params()
    opt, _ = wrapped("adam_fused", params)
    opt.scale_loss(torch.tensor(1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(opt, params, [1, 0, 2])


def test_the_earlier_name_is_the_adapter():
    # `TorchOptimizer` was the adapter's name until 0.1.x: code written for it runs.
    import lossscale.torch as lt

    assert lt.TorchOptimizer is lt.TorchAdapter and "TorchOptimizer" in lt.__all__


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", ["adamw_fused", "sgd_momentum"])
def test_a_copy_with_its_parameters_trains_on_as_the_original(kind, how):
    """`copy.deepcopy` / `pickle` of (parameters, LossScaleOptimizer(torch optimizer)):
    the copy steps its copied parameters and native state bit for bit as the
    original steps its own, through skipped steps, and leaves the original's alone."""
    import copy
    import pickle

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = ls.LossScaleOptimizer(
        NATIVE[kind](params), initial_scale=INITIAL_SCALE, dynamic_growth_steps=GROWTH_STEPS
    )
    rng = np.random.default_rng(1)
    steps = [[rng.normal(size=s).astype(np.float32) * 4 for s in SHAPES] for _ in range(6)]
    steps[0][0][0, 0] = np.inf
    steps[3][1][2] = np.nan

    def step(optimizer, ps, grads):
        optimizer.apply([torch.from_numpy(g.copy()) for g in grads], ps)

    for grads in steps[:2]:
        step(opt, params, grads)
    copied = (
        copy.deepcopy((params, opt))
        if how == "deepcopy"
        else pickle.loads(pickle.dumps((params, opt)))
    )
    copied_params, copied_opt = copied
    before = [p.detach().clone() for p in params]
    for grads in steps[2:]:
        step(copied_opt, copied_params, grads)
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    for grads in steps[2:]:
        step(opt, params, grads)
    for a, b in zip(params, copied_params):
        assert torch.equal(a, b)
    native, copied_native = opt.inner_optimizer.optimizer, copied_opt.inner_optimizer.optimizer
    for p, q in zip(params, copied_params):
        for key, value in native.state[p].items():
            assert torch.equal(value, copied_native.state[q][key]), key
    assert float(opt.dynamic_scale) == float(copied_opt.dynamic_scale)


@pytest.mark.parametrize("name", ["adam_fused", "sgd_momentum"])
def test_state_dict_round_trip_through_torch_save_resumes_the_trajectory(name):
    params = make_params()
    opt, _ = wrapped(name, params)
    run(opt, params, range(6))
    # The wrapper's own variables (the loss scale) ride along as `extra_variables`.
    own = opt.variables[:2]
    buffer = io.BytesIO()
    torch.save(
        {"inner": opt.inner_optimizer.state_dict(extra_variables=own), "params": params}, buffer
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["inner"]["optimizer_variables"] == {
        "loss_scale_optimizer/step_counter": torch.tensor(1),
        "loss_scale_optimizer/dynamic_scale": torch.tensor(8.0),
        "torch_optimizer/iteration": torch.tensor(4),
    }
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in saved["params"]]
    twin, _ = wrapped(name, twin_params)
    twin.build(twin_params)
    twin.inner_optimizer.load_state_dict(saved["inner"], extra_variables=twin.variables[:2])
    run(opt, params, range(6, STEPS))
    run(twin, twin_params, range(6, STEPS))
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    assert int(twin.iterations) == int(opt.iterations) == 7
    assert float(twin.dynamic_scale) == float(opt.dynamic_scale)


def test_state_dict_is_a_copy_a_plain_torch_optimizer_can_load():
    params = make_params()
    opt, native = wrapped("adam", params)
    run(opt, params, [1])
    state = opt.inner_optimizer.state_dict()
    run(opt, params, [2])
    assert int(state["state"][0]["step"]) == 1
    plain = torch.optim.Adam(make_params(), lr=0.01)
    plain.load_state_dict(state)
    assert int(plain.state_dict()["state"][0]["step"]) == 1


def test_load_state_dict_errors_change_nothing():
    params = make_params()
    opt, native = wrapped("adam", params)
    run(opt, params, [1, 2])
    inner = opt.inner_optimizer
    good = inner.state_dict()
    other = TorchAdapter(torch.optim.Adam(make_params()[:2])).state_dict()
    cases = [
        (
            native.state_dict(),
            r"keys \['state', 'param_groups', 'optimizer_variables'\].*"
            r"adapter\.optimizer\.load_state_dict.*Received: \['param_groups', "
            r"'state'\]",
        ),
        ([], r"Received: list"),
        (
            {**good, "optimizer_variables": {"x/iteration": torch.tensor(1)}},
            r"must have the keys \['torch_optimizer/iteration'\] of this optimizer\. Received: "
            r"\['x/iteration'\]",
        ),
        (
            {**good, "optimizer_variables": [torch.tensor(1)]},
            r"must have the keys \['torch_optimizer/iteration'\] of this optimizer\. Received: "
            r"list$",
        ),
        (
            {**good, "optimizer_variables": {"torch_optimizer/iteration": torch.zeros(2)}},
            r"\['torch_optimizer/iteration'\]` must have the shape \(\) of optimizer variable "
            r"'torch_optimizer/iteration'\. Received: shape \(2,\)",
        ),
        (
            {**good, "optimizer_variables": {"torch_optimizer/iteration": "3"}},
            r"must be a tensor, a NumPy array or a number\. Received: '3'",
        ),
        (
            {**good, "optimizer_variables": {"torch_optimizer/iteration": torch.tensor(2.5)}},
            r"\['torch_optimizer/iteration'\]` must hold int values like optimizer variable "
            r"'torch_optimizer/iteration' \(int32\)\. Received: tensor\(2\.5000\)",
        ),
        (
            {**other, "optimizer_variables": good["optimizer_variables"]},
            "doesn't match the size of optimizer's group",
        ),
    ]
    run(opt, params, [3])
    before = inner.state_dict()
    for state_dict, message in cases:
        with pytest.raises(ValueError, match=message):
            inner.load_state_dict(state_dict)
        after = inner.state_dict()
        assert int(inner.iterations) == 3
        for (_, _, a), (_, _, b) in zip(
            state_tensors(native),
            [(i, k, v) for i, e in before["state"].items() for k, v in sorted(e.items())],
        ):
            assert torch.equal(a, b)
        assert after["param_groups"] == before["param_groups"]


@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built"])
@pytest.mark.parametrize("name", ["adam_fused", "sgd_momentum"])
def test_a_fresh_wrapper_loads_a_state_dict_and_resumes(name, built):
    # What torch users do: make the model and optimizer, load, train on.
    params = make_params()
    opt, _ = wrapped(name, params)
    run(opt, params, range(6))
    saved = opt.state_dict()
    frozen = copy.deepcopy(saved)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin, twin_native = wrapped(name, twin_params)
    if built:
        twin.build(twin_params)
    twin.load_state_dict(saved)
    assert twin.dynamic_scale.backend == "torch" and float(twin.dynamic_scale) == 8.0
    run(opt, params, range(6, STEPS))
    run(twin, twin_params, range(6, STEPS))
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    assert int(twin.iterations) == int(opt.iterations)
    assert float(twin.dynamic_scale) == float(opt.dynamic_scale)
    # Training after the load never wrote into the loaded dict.
    for i, entry in frozen["state"].items():
        for key, value in entry.items():
            assert torch.equal(saved["state"][i][key], value), key
    for path, value in frozen["optimizer_variables"].items():
        assert torch.equal(saved["optimizer_variables"][path], value), path


def test_a_fresh_wrapper_loads_nothing_when_any_part_is_wrong():
    params = make_params()
    opt, _ = wrapped("adam_fused", params)
    run(opt, params, range(3))
    good = opt.state_dict()
    bad_scale = copy.deepcopy(good)
    bad_scale["optimizer_variables"]["loss_scale_optimizer/dynamic_scale"] = torch.ones(2)
    other = wrapped("adam_fused", make_params()[:2])[0].inner_optimizer.state_dict(
        extra_variables=opt.variables[:2]
    )
    for state_dict, message in [
        (bad_scale, r"must have the shape \(\) of optimizer variable "),
        (other, "doesn't match the size of optimizer's group"),
    ]:
        twin, twin_native = wrapped("adam_fused", make_params())
        with pytest.raises(ValueError, match=message):
            twin.load_state_dict(state_dict)
        assert not twin_native.state and twin.dynamic_scale.backend == "numpy"
        assert float(twin.dynamic_scale) == INITIAL_SCALE and int(twin.iterations) == 0


def test_a_never_stepped_wrapper_saves_tensors_that_weights_only_loading_reads():
    import lossscale as ls

    params = make_params()
    opt = ls.LossScaleOptimizer(TorchAdapter(torch.optim.Adam(params, lr=0.01)), telemetry=True)
    saved = opt.state_dict()
    assert all(torch.is_tensor(v) for v in saved["optimizer_variables"].values())
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh = ls.LossScaleOptimizer(
        TorchAdapter(torch.optim.Adam(make_params(), lr=0.01)), telemetry=True
    )
    fresh.load_state_dict(loaded)
    assert float(fresh.dynamic_scale.value) == float(opt.dynamic_scale.value)
