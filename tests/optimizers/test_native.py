"""`wrap_native`: native optimizers get their adapter, everything else passes through."""

import copy
import doctest
import subprocess
import sys

import numpy as np
import optax
import pytest
import torch

import lossscale as ls
from lossscale.optax import OptaxAdapter
from lossscale.optimizers import native
from lossscale.optimizers.native import wrap_native
from lossscale.torch import TorchAdapter


def test_native_optimizers_get_their_adapter():
    w = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([w], lr=0.1)
    wrapped = wrap_native(sgd)
    assert isinstance(wrapped, TorchAdapter) and wrapped.optimizer is sgd
    adam = optax.adam(0.1)
    wrapped = wrap_native(adam)
    assert isinstance(wrapped, OptaxAdapter) and wrapped.transformation is adam


def test_other_objects_pass_through():
    ours = ls.optimizers.SGD(0.1)
    adapter = OptaxAdapter(optax.sgd(0.1))
    for obj in (ours, adapter, "adam", None):
        assert wrap_native(obj) is obj


def test_an_unloaded_library_is_not_imported():
    code = (
        "import sys; from lossscale.optimizers.native import wrap_native; "
        "wrap_native(object()); "
        "print(sorted(m for m in ('torch', 'jax', 'optax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


Wrapper = ls.LossScaleOptimizer


def steps(opt, params, grads):
    for g in grads:
        opt.apply([g * opt.scale_loss(torch.tensor(1.0))], params)


@pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")
def test_a_wrapper_checkpoints_a_native_inner_optimizer_through_its_state_dict():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, generator=generator) for _ in range(6)]
    grads[2] = torch.tensor([float("inf"), 0.0, 0.0])
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = Wrapper(
        TorchAdapter(torch.optim.Adam(params, lr=0.1)),
        initial_scale=8.0,
        dynamic_growth_steps=1,
        name="lso",
    )
    steps(opt, params, grads[:4])
    state = opt.state_dict()
    assert sorted(state) == ["optimizer_variables", "param_groups", "state"]
    assert {k: float(v) for k, v in state["optimizer_variables"].items()} == {
        "lso/step_counter": 0.0,
        "lso/dynamic_scale": 32.0,
        "torch_optimizer/iteration": 3.0,
    }
    assert int(state["state"][0]["step"]) == 3
    twin_params = [torch.nn.Parameter(params[0].detach().clone())]
    twin = Wrapper(
        TorchAdapter(torch.optim.Adam(twin_params, lr=0.1)),
        initial_scale=8.0,
        dynamic_growth_steps=1,
        name="lso",
    )
    twin.build(twin_params)
    twin.load_state_dict(state)
    steps(opt, params, grads[4:])
    steps(twin, twin_params, grads[4:])
    assert torch.equal(params[0], twin_params[0])
    assert float(twin.dynamic_scale) == float(opt.dynamic_scale) == 128.0
    for method in ("save_own_variables", "load_own_variables"):
        with pytest.raises(NotImplementedError, match=rf"`{method}`: the wrapped Adam keeps"):
            getattr(opt, method)({})


def test_other_inner_optimizers_keep_the_wrapper_behaviour():
    import jax.numpy as jnp

    opt = Wrapper(OptaxAdapter(optax.adam(0.1)))
    opt.build([jnp.ones(2)])
    store = {}
    opt.save_own_variables(store)
    assert len(store) == len(opt.variables) == 6
    opt.load_own_variables(store)
    assert list(opt.state_dict()["optimizer_variables"]) == [v.path for v in opt.variables]
    opt.load_state_dict(opt.state_dict())


def test_docstring_example():
    result = doctest.testmod(native, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# --- state a wrapper keeps per model variable, before the first step ----------
# Telemetry keeps variables per model variable (named after it), diagnostics
# per model (sized by it): `build` makes them. A torch optimizer knows its
# parameters from the start, so saving or loading before the first step builds.
PER_VARIABLE_SETTINGS = {
    "telemetry": dict(telemetry=True),
    "diagnostics": dict(diagnostics_every=2),
    "both": dict(telemetry=True, diagnostics_every=3),
}


def model_params(seed):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(256, 64), (256,), (10, 256), (10,)]
    return [torch.nn.Parameter(torch.randn(s, generator=generator) * 0.1) for s in shapes]


def model_grads(count):
    generator = torch.Generator().manual_seed(1)
    shapes = [p.shape for p in model_params(0)]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(count)]
    # Overflows in one variable, then in another, so per-variable state differs.
    grads[1][2][3, 7] = float("inf")
    grads[4][0][-1, -1] = float("nan")
    return grads


def model_steps(opt, params, grads):
    for step_grads in grads:
        scale = opt.scale_loss(torch.tensor(1.0))
        opt.apply([g * scale for g in step_grads], params)


def make_wrapper(native, params, settings):
    optimizers = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-2),
        "sgd_momentum": lambda: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    }
    return ls.LossScaleOptimizer(optimizers[native](), initial_scale=2.0**10, **settings)


def values(opt):
    return {v.path: v.numpy() for v in opt.variables}


@pytest.mark.parametrize("native", ["adamw", "sgd_momentum"])
@pytest.mark.parametrize("settings", list(PER_VARIABLE_SETTINGS), ids=str)
def test_a_never_stepped_wrapper_loads_per_variable_state_and_resumes(native, settings):
    grads = model_grads(10)
    params = model_params(0)
    opt = make_wrapper(native, params, PER_VARIABLE_SETTINGS[settings])
    model_steps(opt, params, grads[:6])
    saved = opt.state_dict()
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = make_wrapper(native, twin_params, PER_VARIABLE_SETTINGS[settings])
    assert not twin.built
    twin.load_state_dict(saved)
    assert values(twin).keys() == values(opt).keys()
    for path, value in values(opt).items():
        np.testing.assert_array_equal(values(twin)[path], value, err_msg=path)
    if "telemetry" in PER_VARIABLE_SETTINGS[settings]:
        bits = {path: int(v) for path, v in values(twin).items() if path.endswith("overflow_bits")}
        assert sorted(path for path, b in bits.items() if b) == [
            "loss_scale_optimizer/param_0_overflow_bits",
            "loss_scale_optimizer/param_2_overflow_bits",
        ]
    model_steps(opt, params, grads[6:])
    model_steps(twin, twin_params, grads[6:])
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    for path, value in values(opt).items():
        np.testing.assert_array_equal(values(twin)[path], value, err_msg=path)


@pytest.mark.parametrize("settings", list(PER_VARIABLE_SETTINGS), ids=str)
def test_a_state_dict_saved_before_the_first_step_holds_every_variable(settings):
    grads = model_grads(8)
    params = model_params(0)
    before = make_wrapper("adamw", params, PER_VARIABLE_SETTINGS[settings])
    initial = before.state_dict()
    model_steps(before, params, grads[:1])
    assert (
        initial["optimizer_variables"].keys() == before.state_dict()["optimizer_variables"].keys()
    )
    # Loading it into a wrapper that has stepped resets that wrapper to a fresh one.
    params_a, params_b = model_params(3), model_params(3)
    stepped = make_wrapper("adamw", params_a, PER_VARIABLE_SETTINGS[settings])
    model_steps(stepped, params_a, grads[:5])
    stepped.load_state_dict(copy.deepcopy(initial))
    fresh = make_wrapper("adamw", params_b, PER_VARIABLE_SETTINGS[settings])
    fresh.build(params_b)
    for path, value in values(fresh).items():
        if path != "torch_optimizer/iteration":
            np.testing.assert_array_equal(values(stepped)[path], value, err_msg=path)
    with torch.no_grad():
        for a, b in zip(params_a, params_b):
            a.copy_(b)
    model_steps(stepped, params_a, grads[5:])
    model_steps(fresh, params_b, grads[5:])
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)


def test_a_wrapper_without_per_variable_state_stays_unbuilt():
    params = model_params(0)
    opt = make_wrapper("adamw", params, {})
    saved = opt.state_dict()
    assert not opt.built and len(saved["optimizer_variables"]) == 3
    twin = make_wrapper("adamw", model_params(0), {})
    twin.load_state_dict(saved)
    assert not twin.built


def test_a_dict_that_does_not_fit_leaves_a_never_stepped_wrapper_as_it_was():
    grads = model_grads(6)
    params = model_params(0)
    opt = make_wrapper("adamw", params, dict(telemetry=True))
    model_steps(opt, params, grads)
    good = opt.state_dict()
    renamed = copy.deepcopy(good)
    bits = renamed["optimizer_variables"].pop("loss_scale_optimizer/param_2_overflow_bits")
    renamed["optimizer_variables"]["loss_scale_optimizer/head_overflow_bits"] = bits
    wrong_shape = copy.deepcopy(good)
    wrong_shape["optimizer_variables"]["loss_scale_optimizer/param_1_nonfinite"] = torch.zeros(3)
    for state_dict, message in [
        (renamed, r"must have the keys \[.*'loss_scale_optimizer/param_2_overflow_bits'"),
        (wrong_shape, r"param_1_nonfinite'\]` must have the shape \(\) of optimizer variable"),
    ]:
        twin = make_wrapper("adamw", model_params(0), dict(telemetry=True))
        initial = values(twin)
        with pytest.raises(ValueError, match=message):
            twin.load_state_dict(state_dict)
        assert not twin.inner_optimizer.optimizer.state
        for path, value in values(twin).items():
            np.testing.assert_array_equal(value, initial.get(path, np.zeros_like(value)))
