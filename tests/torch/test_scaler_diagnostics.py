"""GradScaler's diagnostics (`scaler_diagnostics`) and `watch` on real training loops.

Overflows injected into a chosen layer are traced to its name under
`GradScaler` (torch's AdamW fused and not, `lossscale.torch.Optimizer`) and
under `LossScaleOptimizer`; a NaN loss is reported as one; the float16
range equals a float64 NumPy count of the same scaled gradients; a step
with everything on reads nothing on the host; with diagnostics on, the run
is the run without them.
"""

import contextlib
import copy

import numpy as np
import pytest
import torch

import lossscale as ls
import lossscale.torch as lt
from tests import grad_scaler_cases as cases
from tests.torch_cases import no_host_reads

FLOAT16_MAX = float(np.finfo(np.float16).max)
TINY16 = float(np.finfo(np.float16).smallest_normal)


def injected_model():
    """The shared transformer, made to overflow in backward in `encoder.linear2` only.

    `linear1` shrunk 1000x and `linear2`'s weight grown 1000x: the forward
    values are as before, the gradient of `linear2`'s input 1000x larger.
    """
    model = cases.TinyTransformer()
    with torch.no_grad():
        model.encoder.linear1.weight.mul_(1e-3)
        model.encoder.linear1.bias.mul_(1e-3)
        model.encoder.linear2.weight.mul_(1e3)
    return model


def optimizer_for(model, kind):
    params = model.named_parameters()
    if kind == "lossscale":
        return lt.Optimizer([p for _, p in params], ls.optimizers.AdamW(1e-3))
    return torch.optim.AdamW(params, lr=1e-3, fused=kind == "fused", foreach=kind != "fused")


def scaled_steps(scaler, model, optimizer, steps, poison=()):
    tokens, targets = cases.batch()
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = cases.loss_of(model, tokens, targets)
        if step in poison:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.parametrize("kind", ["fused", "foreach", "lossscale"])
def test_an_injected_overflow_is_traced_to_its_layer_under_grad_scaler(kind):
    model = injected_model()
    optimizer = optimizer_for(model, kind)
    scaler = lt.GradScaler("cpu", init_scale=2.0**16, telemetry=True, history_length=4)
    handle = lt.watch(model, scaler)
    scaled_steps(scaler, model, optimizer, steps=3)
    overflows = scaler.summary()["overflows"]
    handle.remove()
    assert [o["step"] for o in overflows] == [0, 1, 2]
    for o in overflows:
        assert o["module"] == "encoder.linear2" and o["loss_finite"] is True
        # Below linear2 in backward every gradient is inf; above it none is.
        assert "encoder.linear1.weight" in o["variables"]
        assert (
            "head.weight" not in o["variables"] and "encoder.linear2.weight" not in o["variables"]
        )


def test_an_injected_overflow_is_traced_to_its_layer_under_loss_scale_optimizer():
    model = injected_model()
    params = list(model.parameters())
    opt = ls.LossScaleOptimizer(ls.optimizers.AdamW(1e-3), initial_scale=2.0**16, telemetry=True)
    lt.watch(model, opt)
    tokens, targets = cases.batch()
    for _ in range(2):
        opt.scale_loss(cases.loss_of(model, tokens, targets)).backward()
        opt.apply([p.grad for p in params], params)
        model.zero_grad(set_to_none=True)
    overflows = opt.summary()["overflows"]
    # The first `scale_loss` comes before the optimizer is built: the loss is not recorded.
    assert [(o["step"], o["module"], o["loss_finite"]) for o in overflows] == [
        (0, "encoder.linear2", None),
        (1, "encoder.linear2", True),
    ]


def test_a_nan_loss_is_reported_as_such():
    model = cases.TinyTransformer()
    optimizer = optimizer_for(model, "fused")
    scaler = lt.GradScaler("cpu", init_scale=2.0**10, telemetry=True)
    lt.watch(model, scaler)
    scaled_steps(scaler, model, optimizer, steps=4, poison=(2,))
    (overflow,) = scaler.summary()["overflows"]
    assert overflow["step"] == 2 and overflow["loss_finite"] is False
    assert overflow["module"] is None  # the NaN came after the model
    assert len(overflow["variables"]) == len(list(model.parameters()))
    failing = lt.GradScaler("cpu", init_scale=2.0**10, max_consecutive_skips=0)
    lt.watch(model, failing)
    with pytest.raises(ls.LossScaleError) as info:
        scaled_steps(failing, model, optimizer_for(model, "fused"), steps=2, poison=(1,))
    assert "step 1: the loss was NaN/inf" in str(info.value)
    assert "'head.weight'" in str(info.value)


def test_an_overflow_error_names_the_module_and_the_parameters():
    model = injected_model()
    scaler = lt.GradScaler("cpu", init_scale=2.0**16, max_consecutive_skips=1)
    lt.watch(model, scaler)
    with pytest.raises(ls.LossScaleError) as info:
        scaled_steps(scaler, model, optimizer_for(model, "fused"), steps=3)
    message = str(info.value)
    assert "step 1: gradients overflowed (the loss was finite)" in message
    assert "starting in module 'encoder.linear2'" in message
    assert "'encoder.linear1.weight'" in message


# -- the float16 range against a float64 count ------------------------------------

# Both sides of 4096 and of 2**18 elements.
SIZES = (4095, 4097, 2**18 - 1, 2**18 + 1)


def scaled_gradient(rng, size, growth_factor):
    """A float32 scaled gradient holding every kind of value, at edges and random spots."""
    g = rng.normal(scale=30.0, size=size).astype(np.float32)
    specials = [
        0.0,
        -0.0,
        TINY16 / 4,
        -TINY16 / 2,
        TINY16,
        FLOAT16_MAX / growth_factor,
        np.nextafter(np.float32(FLOAT16_MAX / growth_factor), 0),
        -FLOAT16_MAX,
        np.inf,
        -np.inf,
        np.nan,
    ]
    spots = [0, size - 1, size // 2, 4095 % size, *rng.integers(0, size, 40)]
    for k, at in enumerate(spots):
        g[at] = specials[k % len(specials)]
    g[rng.integers(0, size, size // 7)] = 0.0
    return g


def float64_range(g, growth_factor):
    a = np.abs(g.astype(np.float64))
    finite_max = np.nan if np.isnan(a).any() else a.max()
    return {
        "zero": np.count_nonzero(a == 0) / a.size,
        "subnormal": np.count_nonzero((a > 0) & (a < TINY16)) / a.size,
        "near_max": np.count_nonzero(a >= np.float32(FLOAT16_MAX / growth_factor)) / a.size,
        "max_abs": finite_max,
    }


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_float16_range_equals_a_float64_count(kind):
    rng = np.random.default_rng(7)
    growth_factor = 4.0
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in SIZES])
    names = [f"p{i}" for i in range(len(SIZES))]
    optimizer = torch.optim.AdamW(
        [{"params": list(params), "param_names": names}],
        fused=kind == "fused",
        foreach=kind != "fused",
    )
    scaler = lt.GradScaler("cpu", growth_factor=growth_factor, diagnostics_every=3)
    scaler.scale(torch.ones(()))
    expected = {}
    for step in range(4):
        grads = [scaled_gradient(rng, n, growth_factor) for n in SIZES]
        if step != 2:  # a finite step too
            grads[1][:] = np.abs(grads[1]).clip(0, 1e3)
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g.copy())
        if step % 3 == 0:
            expected = {n: float64_range(g, growth_factor) for n, g in zip(names, grads)}
            at = step
        scaler.step(optimizer)
        scaler.update()
    summary = scaler.summary()
    assert summary["float16_range_step"] == at == 3
    assert set(summary["float16_range"]) == set(names)
    for name in names:
        got, want = summary["float16_range"][name], expected[name]
        for key in ("zero", "subnormal", "near_max"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=0), (name, key)
        assert (
            np.isnan(got["max_abs"])
            if np.isnan(want["max_abs"])
            else got["max_abs"] == want["max_abs"]
        )


def test_parameter_names_come_from_watch_then_param_groups_then_places():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    runs = {}
    for source in ("watch", "param_names", "places"):
        if source == "places":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1)
        scaler = lt.GradScaler("cpu", telemetry=True)
        handle = None
        if source == "watch":
            named = torch.nn.ModuleDict({"net": model})
            handle = lt.watch(named, scaler)
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(1, 3)).sum() * float("inf")).backward()
        scaler.step(optimizer)
        scaler.update()
        runs[source] = scaler.summary()["overflows"][0]["variables"]
        if handle is not None:
            handle.remove()
    assert runs["watch"] == ["net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias"]
    assert runs["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert runs["places"] == ["group0.param0", "group0.param1", "group0.param2", "group0.param3"]


# -- what a step costs and changes ---------------------------------------------------


def test_a_step_with_diagnostics_and_watch_reads_nothing_on_the_host():
    model = injected_model()
    optimizer = optimizer_for(model, "fused")
    # With hysteresis the scale stays put: every step overflows in linear2.
    scaler = lt.GradScaler(
        "cpu", init_scale=2.0**16, telemetry=True, diagnostics_every=1, hysteresis=8
    )
    lt.watch(model, scaler)
    scaled_steps(scaler, model, optimizer, steps=1)  # the scale is created
    with no_host_reads():
        scaled_steps(scaler, model, optimizer, steps=3)
    summary = scaler.summary()
    assert summary["float16_range_step"] == 3
    assert [o["module"] for o in summary["overflows"]] == ["encoder.linear2"] * 4


def test_with_diagnostics_on_the_run_is_the_run_without_them():
    plain = cases.train(lt.GradScaler("cpu", init_scale=cases.INIT_SCALE, growth_interval=3))
    model = cases.TinyTransformer()
    watched = lt.GradScaler(
        "cpu", init_scale=cases.INIT_SCALE, growth_interval=3, telemetry=True, diagnostics_every=2
    )
    handle = lt.watch(model, watched)
    run = cases.train(watched, model=model)
    handle.remove()
    assert run["scales"] == plain["scales"] and run["skipped"] == plain["skipped"]
    assert cases.same_weights(run["params"], plain["params"])


def test_remove_unregisters_and_leaves_no_hook():
    model = injected_model()
    scaler = lt.GradScaler("cpu", init_scale=2.0**16, telemetry=True)
    handle = lt.watch(model, scaler)
    optimizer = optimizer_for(model, "fused")
    scaled_steps(scaler, model, optimizer, steps=1)
    handle.remove()
    scaled_steps(scaler, model, optimizer, steps=1)
    assert [o["module"] for o in scaler.summary()["overflows"]] == [None, None]
    assert all(not m._forward_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())


def test_the_new_fields_survive_a_state_dict_round_trip():
    model = cases.TinyTransformer()
    settings = dict(init_scale=cases.INIT_SCALE, telemetry=True, diagnostics_every=4)
    first = lt.GradScaler("cpu", **settings, history_length=5)
    scaled_steps(first, model, optimizer_for(model, "fused"), steps=6, poison=(4,))
    state = first.state_dict()
    assert state["lossscale"]["overflow_loss"][-1] == 0 and state["lossscale"]["range_step"] == 4
    second = lt.GradScaler("cpu", **settings, history_length=5)
    second.load_state_dict(state)
    assert second.state_dict() == state
    loaded = second.summary()["overflows"]
    assert [(o["step"], o["loss_finite"]) for o in loaded] == [
        (o["step"], o["loss_finite"]) for o in first.summary()["overflows"]
    ]


def test_watch_needs_the_overflow_window():
    with pytest.raises(ValueError, match="`watch` reports into the overflow window"):
        lt.watch(cases.TinyTransformer(), lt.GradScaler("cpu"))
    with pytest.raises(ValueError, match="needs the overflow window"):
        lt.GradScaler("cpu").register_step_observer(object())
    with pytest.raises(ValueError, match="`scaler_or_optimizer` must be"):
        lt.watch(cases.TinyTransformer(), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))


@pytest.mark.parametrize("growth_policy", ["fixed", "headroom"])
def test_telemetry_names_the_overflowing_parameter_beside_an_empty_one(growth_policy):
    # One multi-tensor norm per dtype measures every gradient for the
    # policy (`inspection.inspect`); an empty gradient has no peak (the
    # norm has none to give) and is left out, not raised on.
    names = ("w_bf16", "empty", "w32")
    params = [
        torch.nn.Parameter(torch.ones(300, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.ones(0)),
        torch.nn.Parameter(torch.ones(70000)),
    ]
    optimizer = torch.optim.SGD([{"params": params, "param_names": list(names)}], lr=0.0)
    scaler = lt.GradScaler("cpu", init_scale=2.0**4, telemetry=True, growth_policy=growth_policy)
    for bad in (None, 69999):
        grads = [torch.full((300,), 0.5, dtype=torch.bfloat16), torch.ones(0), torch.ones(70000)]
        if bad is not None:
            grads[2][bad] = float("inf")
        for p, g in zip(params, grads):
            p.grad = g
        scaler.scale(torch.ones(()))  # the loss: the gradients are set by hand
        scaler.step(optimizer)
        scaler.update()
    summary = scaler.summary()
    assert summary["skipped_steps"] == 1
    assert summary["overflows"][-1]["variables"] == ["w32"]


def test_between_measurements_a_plain_policy_updates_with_torchs_kernel():
    """`diagnostics_every=N` and nothing else: an update off a measuring step is the plain one.

    The same run bit for bit, the count of steps kept (so each N-th step
    measures), and off a measuring step exactly the operations of the plain
    update (torch's kernel): the count is kept on the host there, and
    written to the device where it is read next.
    """
    from tests.torch_cases import count_ops

    plain = lt.GradScaler("cpu", init_scale=cases.INIT_SCALE, growth_interval=3)
    measured = lt.GradScaler(
        "cpu", init_scale=cases.INIT_SCALE, growth_interval=3, diagnostics_every=5
    )
    want, run = cases.train(plain), cases.train(measured)
    assert run["scales"] == want["scales"] and run["skipped"] == want["skipped"]
    assert any(run["skipped"]) and not all(run["skipped"])
    assert cases.same_weights(run["params"], want["params"])
    summary = measured.summary()
    assert summary["steps"] == cases.STEPS and summary["float16_range_step"] == 30
    assert len(summary["float16_range"]) == len(list(run["model"].parameters()))
    updates = {}
    for name, scaler, result in (("plain", plain, want), ("measured", measured, run)):
        result["optimizer"].zero_grad()
        cases.loss_of(result["model"], *cases.batch()).backward()  # an unscaled step: finite
        scaler.step(result["optimizer"])
        with count_ops() as seen:
            scaler.update()
        updates[name] = seen
    assert updates["plain"][0] == "aten._amp_update_scale_.default"
    assert updates["measured"] == updates["plain"]
    # Read between measurements (the count is behind on the device there):
    # the summary, a state dict, a copy.
    assert measured.summary()["steps"] == cases.STEPS + 1
    assert measured.state_dict()["lossscale"]["steps"] == cases.STEPS + 1
    assert copy.deepcopy(measured).summary()["steps"] == cases.STEPS + 1


@pytest.mark.parametrize(
    "settings",
    [{}, {"telemetry": True}, {"growth_policy": "statistics"}],
    ids=["plain", "telemetry", "statistics"],
)
def test_a_parameter_not_measured_keeps_its_last_measurement(settings):
    """Two optimizers, and gradients that come and go: each name's newest measurement.

    A measuring update keeps each optimizer's vectors as measured; the
    first time a measurement names other parameters (the second optimizer's,
    a parameter without a gradient) they are merged (`scaler_ranges`).
    """
    rng = np.random.default_rng(19)
    growth_factor = 2.0
    sizes = {"a.w": 3000, "a.b": 70_000, "b.w": 513, "b.b": 129}
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in sizes.items()}
    optimizers = [
        torch.optim.SGD([{"params": [params[n] for n in group], "param_names": group}], lr=0.0)
        for group in (["a.w", "a.b"], ["b.w", "b.b"])
    ]
    scaler = lt.GradScaler("cpu", diagnostics_every=2, **settings)
    scaler.scale(torch.ones(()))
    # Who has a gradient, per step; which optimizers step.
    plan = [
        ({"a.w", "a.b"}, [0]),
        ({"a.w", "a.b"}, [0]),
        ({"a.w", "a.b", "b.w", "b.b"}, [0, 1]),
        (set(sizes), [0, 1]),
        ({"a.b", "b.w"}, [0, 1]),
        (set(sizes), [0, 1]),
        ({"b.b", "a.w"}, [0, 1]),
    ]
    want = {}
    for step, (present, stepped) in enumerate(plan):
        for name, p in params.items():
            p.grad = None
            if name in present:
                p.grad = torch.from_numpy(scaled_gradient(rng, sizes[name], growth_factor))
        if step % 2 == 0:
            for k in stepped:
                for name in optimizers[k].param_groups[0]["param_names"]:
                    if name in present:
                        want[name] = float64_range(params[name].grad.numpy(), growth_factor)
        for k in stepped:
            scaler.step(optimizers[k])
        scaler.update()
        summary = scaler.summary()
        assert summary["float16_range_step"] == step - step % 2
        assert set(summary["float16_range"]) == set(want)
        for name, expected in want.items():
            got = summary["float16_range"][name]
            for key in ("zero", "subnormal", "near_max"):
                assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=0), (step, name)
            assert np.isnan(got["max_abs"]) and np.isnan(expected["max_abs"]), (step, name)


def test_a_measuring_update_of_a_plain_policy_adds_one_operation():
    """The measurement's update: torch's kernel and the measured step's write, nothing per parameter.

    (It built a scalar per parameter and field, and indexed each out of the
    measurement's vectors: 4 x 28 operations on this model.)
    """
    from tests.torch_cases import count_ops

    run = {}
    for every in (None, 1):
        scaler = lt.GradScaler("cpu", init_scale=cases.INIT_SCALE, diagnostics_every=every)
        result = cases.train(scaler)
        result["optimizer"].zero_grad()
        cases.loss_of(result["model"], *cases.batch()).backward()
        scaler.step(result["optimizer"])
        with count_ops() as seen:
            scaler.update()
        run[every] = seen
    assert run[1] == ["aten.fill_.Scalar", *run[None]]


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_unscale_before_step_measures_the_scaled_gradients(kind):
    """`unscale_` then clipping then `step`: the range is the scaled gradients', measured once."""
    rng = np.random.default_rng(23)
    growth_factor = 2.0
    sizes = (4095, 70_001)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    names = ["small", "large"]
    optimizer = torch.optim.AdamW(
        [{"params": params, "param_names": names}],
        fused=kind == "fused",
        foreach=kind != "fused",
    )
    scaler = lt.GradScaler("cpu", growth_factor=growth_factor, diagnostics_every=1)
    scaler.scale(torch.ones(()))
    # Every kind of value but inf and NaN: a step that is applied, its gradients clipped.
    grads = [
        np.nan_to_num(scaled_gradient(rng, n, growth_factor), nan=0.0, posinf=6e4, neginf=-6e4)
        for n in sizes
    ]
    for p, g in zip(params, grads):
        p.grad = torch.from_numpy(g.copy())
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(optimizer)
    scaler.update()
    summary = scaler.summary()
    assert summary["float16_range_step"] == 0
    for name, g in zip(names, grads):
        got, want = summary["float16_range"][name], float64_range(g, growth_factor)
        for key in ("zero", "subnormal", "near_max"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=0), (name, key)
        assert got["max_abs"] == want["max_abs"]
    assert scaler.last_step_skipped is False  # applied: the clipped, unscaled gradients


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_measurements_of_other_parameters_are_merged_without_a_host_read(device):
    """The merge of `scaler_ranges` (a parameter without a gradient, then with) waits for nothing.

    On CPU every host read raises (`no_host_reads`); on CUDA, torch's sync
    debug mode raises on any synchronisation.
    """
    params = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in (300, 5000, 70_000)]
    names = ["a", "b", "c"]
    # Fused: an optimizer without a fused kernel is read on the host by torch's protocol.
    optimizer = torch.optim.AdamW([{"params": params, "param_names": names}], fused=True)
    scaler = lt.GradScaler(device, telemetry=True, diagnostics_every=1)
    rng = np.random.default_rng(29)

    def step(present):
        for p in params:
            p.grad = None
        for i in present:
            values = rng.normal(size=params[i].numel()).astype(np.float32)
            params[i].grad = torch.from_numpy(values).to(device)
        scaler.scale(torch.ones((), device=device))
        scaler.step(optimizer)
        scaler.update()

    step([0, 1, 2])  # the scale and the state are made
    with no_host_reads() if device == "cpu" else _cuda_sync_raises():
        step([0, 2])  # measured: a and c, merged with the first measurement
        step([1])  # b alone
        step([0, 1, 2])
    summary = scaler.summary()
    assert list(summary["float16_range"]) == names
    assert summary["float16_range_step"] == 3


@contextlib.contextmanager
def _cuda_sync_raises():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
