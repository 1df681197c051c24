"""torch/adapter_checkpoint.py: `TorchAdapter.state_dict` / `load_state_dict`.

The native optimizer's state dict, copied, plus the adapter's step counter
and a wrapper's own variables (`extra_variables`): round trips through
`torch.save` resume the trajectory bit for bit, a fresh wrapper (built or
not) loads and resumes, the dict is a snapshot both ways, and a bad dict
raises, naming what is wrong, before anything is written. The trajectory
helpers are test_adapter.py's.
"""

import copy
import io

import pytest
import torch

from lossscale.torch import TorchAdapter
from tests.torch.test_adapter import INITIAL_SCALE, STEPS, make_params, run, state_tensors, wrapped

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


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
