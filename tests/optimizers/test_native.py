"""`wrap_native`: native optimizers get their adapter, everything else passes through."""

import doctest
import subprocess
import sys

import optax
import pytest
import torch

import lossscale as ls
from lossscale.optax import OptaxAdapter
from lossscale.optimizers import native
from lossscale.optimizers.native import NativeInnerStateMixin, wrap_native
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


# A `LossScaleOptimizer` with the mixin first among its bases, as it is meant to be.
Wrapper = (
    ls.LossScaleOptimizer
    if issubclass(ls.LossScaleOptimizer, NativeInnerStateMixin)
    else (type("Wrapper", (NativeInnerStateMixin, ls.LossScaleOptimizer), {}))
)


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
