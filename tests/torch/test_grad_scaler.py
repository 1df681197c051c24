"""`lossscale.torch.GradScaler` against `torch.amp.GradScaler`, bit for bit.

The shared loop (tests/grad_scaler_cases.py) is a float16-autocast
transformer whose first steps overflow; every comparison runs it with
torch's scaler and with ours. Then, in torch's order: how ours unscales and
checks (the guards where it differs: a gradient that overflows only once
unscaled, fail-fast skips), when `step` steps the optimizer, the update and
the diagnostics with `watch`. State dicts are in test_scaler_state.py;
Lightning, Accelerate and torch.distributed in test_grad_scaler_ecosystem.py.
"""

import contextlib
import copy
import doctest
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import lossscale
import lossscale as ls
import lossscale.torch as lt
from tests import grad_scaler_cases as cases
from tests.torch_cases import no_host_reads

TINY = float(np.finfo(np.float32).tiny)


def pair(**extras):
    """torch's scaler and ours, with the loop's settings (and our extras)."""
    settings = dict(init_scale=cases.INIT_SCALE, growth_interval=cases.GROWTH_INTERVAL)
    return torch.amp.GradScaler("cpu", **settings), lt.GradScaler("cpu", **settings, **extras)


def test_lossscale_does_not_import_torch_and_lossscale_torch_does():
    code = (
        "import sys, lossscale; before = 'torch' in sys.modules; "
        "import lossscale.torch; print(before, 'torch' in sys.modules, "
        "issubclass(lossscale.torch.GradScaler, sys.modules['torch'].amp.GradScaler))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"]


def test_docstring_example():
    import lossscale.torch.grad_scaler as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "kind, clip", [("fused", None), ("foreach", None), ("foreach", 0.5), ("fused", 0.5)]
)
def test_training_is_bit_identical_to_torch(kind, clip):
    theirs, ours = pair()
    a = cases.train(theirs, kind, clip=clip)
    b = cases.train(ours, kind, clip=clip)
    assert b["skipped"] == a["skipped"]
    assert b["scales"] == a["scales"]
    assert cases.same_weights(a["params"], b["params"])
    # The run exercised every branch: skips, growths and backoffs after growth.
    assert sum(a["skipped"]) >= 8
    growths = [later > earlier for earlier, later in zip(a["scales"], a["scales"][1:])]
    assert sum(growths) >= 4
    assert not a["skipped"][-1] or a["skipped"][:-1].count(False) > 10


def test_poisoned_steps_and_several_optimizers_match_torch():
    """Two optimizers on one scaler: each skips on its own overflow, the scale on any."""

    def run(scaler):
        model = cases.TinyTransformer()
        first = torch.optim.AdamW(model.head.parameters(), lr=3e-3, fused=True)
        rest = [p for n, p in model.named_parameters() if not n.startswith("head.")]
        second = torch.optim.SGD(rest, lr=0.1, momentum=0.9, foreach=True)
        tokens, targets = cases.batch()
        scales, steps = [], []
        for step in range(12):
            loss = cases.loss_of(model, tokens, targets)
            model.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if step == 6:  # an inf in the second optimizer's gradients only
                model.embed.weight.grad[3, 1] = float("inf")
            scaler.step(first)
            scaler.step(second)
            scaler.update()
            scales.append(scaler.get_scale())
            steps.append(cases.applied_steps(first))
        return scales, steps, [p.detach().clone() for p in model.parameters()]

    theirs, ours = (
        cls("cpu", init_scale=2.0**10, growth_interval=2)
        for cls in (torch.amp.GradScaler, lt.GradScaler)
    )
    a, b = run(theirs), run(ours)
    assert a[0] == b[0] and a[1] == b[1]
    assert cases.same_weights(a[2], b[2])
    assert a[0][6] == a[0][5] / 2 and a[1][6] == a[1][5] + 1  # the first optimizer stepped


def test_scale_of_nested_outputs_matches_torch():
    theirs, ours = pair()
    x = torch.arange(3.0)
    outputs = [x, (x + 1, [x * 2]), x - 1]
    for scaled_theirs, scaled_ours in zip(
        [theirs.scale(outputs), theirs.scale(x)], [ours.scale(outputs), ours.scale(x)]
    ):
        assert type(scaled_theirs) is type(scaled_ours)
        assert repr(scaled_theirs) == repr(scaled_ours)
    generator = ours.scale(t for t in (x, x))
    assert [t.tolist() for t in generator] == [(x * cases.INIT_SCALE).tolist()] * 2
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        ours.scale([x, 3])


def test_getters_setters_and_is_enabled():
    scaler = lt.GradScaler("cpu", init_scale=8.0, growth_interval=5)
    assert scaler.is_enabled() and scaler.get_scale() == 8.0  # before the first scale()
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (2.0, 0.5)
    assert scaler.get_growth_interval() == 5
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(1)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (4.0, 0.25)
    assert scaler.get_growth_interval() == 1
    assert (scaler.policy.growth_factor, scaler.policy.backoff_factor) == (4.0, 0.25)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for grad, expected in ((1.0, 32.0), (float("nan"), 8.0)):  # the new settings apply
        scaler.scale(torch.ones(()))
        p.grad = torch.full((2,), grad)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == expected
    scaler.update(new_scale=3.0)
    assert scaler.get_scale() == 3.0
    scaler.update(new_scale=torch.tensor(5.0))
    assert scaler.get_scale() == 5.0 and scaler._get_growth_tracker() == 0


def test_disabled_scaler_behaves_as_torch():
    theirs = torch.amp.GradScaler("cpu", enabled=False)
    ours = lt.GradScaler("cpu", enabled=False, telemetry=True)
    x = torch.ones(2)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    for scaler in (theirs, ours):
        assert scaler.scale(x) is x and not scaler.is_enabled()
        p.grad = torch.tensor([float("inf"), 1.0])
        scaler.unscale_(opt)
        scaler.step(opt)  # not skipped: a disabled scaler only calls step()
        scaler.update()
        assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
        scaler.load_state_dict({})
    assert p.tolist() == [float("-inf"), 0.0]
    assert ours.summary() == {} and ours.check() is None


def test_the_default_cuda_scaler_is_enabled_only_with_cuda_as_torchs():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = lt.GradScaler()
        theirs = torch.amp.GradScaler()
    assert scaler.is_enabled() is theirs.is_enabled() is torch.cuda.is_available()
    disabling = [w for w in caught if "CUDA is not available" in str(w.message)]
    assert len(disabling) == (0 if torch.cuda.is_available() else 2)


def test_backoff_stops_at_the_smallest_normal_float32():
    theirs, ours = (
        cls("cpu", init_scale=2.0**-124) for cls in (torch.amp.GradScaler, lt.GradScaler)
    )
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    trajectories = []
    for scaler in (theirs, ours):
        scales = []
        for _ in range(5):
            scaler.scale(torch.ones(()))
            p.grad = torch.tensor([float("nan")])
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        trajectories.append(scales)
    assert trajectories[0] == [2.0**-125, 2.0**-126, 2.0**-127, 2.0**-128, 2.0**-129]
    assert trajectories[1] == [2.0**-125, TINY, TINY, TINY, TINY]


def test_the_scale_never_grows_to_inf_as_in_torch():
    for cls in (torch.amp.GradScaler, lt.GradScaler):
        scaler = cls("cpu", init_scale=2.0**127, growth_interval=1)
        p = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler.scale(torch.ones(()))
        p.grad = torch.ones(1)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0**127 and scaler._get_growth_tracker() == 0


_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts tensor reads on the host made by GradScaler code (ours or torch's)."""
    scaler_files = ("lossscale/torch/", "torch/amp/grad_scaler.py")
    counts = []
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if any(part in caller for part in scaler_files):
                counts.append(caller)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return counts


def _steps_without_reading_the_scale(scaler, kind, steps):
    model = cases.TinyTransformer()
    opt = cases.make_optimizer(model, kind)
    tokens, targets = cases.batch()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        scaler.scale(cases.loss_of(model, tokens, targets)).backward()
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("kind, steps, per_step", [("fused", 15, 0), ("foreach", 40, 1)])
def test_host_reads_per_step_are_torchs(host_reads, kind, steps, per_step):
    """torch reads the flag of a non-fused optimizer each step; we read it (and the scale) once.

    A fused optimizer is not read at all while the bound on the scale stays
    at least 1 (16 updates from 2**16); a non-fused one keeps the bound
    exact through that read, so it never needs another.
    """
    for cls in (torch.amp.GradScaler, lt.GradScaler):
        host_reads.clear()
        scaler = cls("cpu", init_scale=2.0**16, growth_interval=10**6)
        _steps_without_reading_the_scale(scaler, kind, steps=steps)
        assert len(host_reads) == steps * per_step, (cls, host_reads)


def test_fused_path_reads_the_scale_once_per_log2_scale_steps(host_reads):
    scaler = lt.GradScaler("cpu", init_scale=2.0**4, growth_interval=10**6)
    _steps_without_reading_the_scale(scaler, "fused", steps=12)
    # The bound halves at each update and falls below 1 after the 4th and the
    # 8th: the scale is read before the 5th and the 9th step.
    assert len(host_reads) == 2
    assert scaler.get_scale() == 2.0**4


def test_hysteresis_backs_off_on_the_second_overflow_in_a_row():
    theirs, ours = pair(hysteresis=2)
    ours_run = cases.train(ours)
    scales, skipped = [cases.INIT_SCALE] + ours_run["scales"], ours_run["skipped"]
    streak = 0
    for k, skip in enumerate(skipped):
        streak = streak + 1 if skip else 0
        if skip:
            assert scales[k + 1] == (scales[k] / 2 if streak >= 2 else scales[k]), k
    assert skipped[:2] == [True, True] and scales[1] == scales[0]
    torch_run = cases.train(theirs)
    assert sum(ours_run["skipped"]) > sum(torch_run["skipped"])


def test_max_scale_caps_growth_and_min_scale_fails_fast():
    settings = dict(init_scale=2.0**18, growth_interval=cases.GROWTH_INTERVAL)
    free = cases.train(lt.GradScaler("cpu", **settings))
    capped = cases.train(lt.GradScaler("cpu", **settings, max_scale=2.0**19))
    assert max(free["scales"]) == 2.0**20  # where the loop overflows
    assert max(capped["scales"]) == 2.0**19 and capped["scales"][-1] == 2.0**19
    assert not any(capped["skipped"])

    _, ours = pair(min_scale=2.0**21, telemetry=True)
    with pytest.raises(lossscale.LossScaleError) as info:
        cases.train(ours)
    message = str(info.value)
    assert message.startswith("Loss scaling failed at step 3: overflow: gradients of ")
    assert "Stopped because the loss scale would fall below `min_scale`" in message
    assert "min_scale=2097152.0" in message and "in total: 4 of 4" in message
    # The parameters are named (by their place in the param groups, here).
    assert "variables (group0.param" in message
    assert ours.get_scale() == 2.0**21


def test_max_consecutive_skips_raises_and_later_steps_stay_skipped():
    _, ours = pair(max_consecutive_skips=2)
    model = cases.TinyTransformer()
    opt = cases.make_optimizer(model, "fused")
    with pytest.raises(lossscale.LossScaleError, match="more than `max_consecutive_skips`"):
        cases.train(ours, model=model, optimizer=opt)
    assert cases.applied_steps(opt) == 0
    with pytest.raises(lossscale.LossScaleError, match="at step 2:"):
        ours.check()
    assert ours.summary()["error_step"] == 2 and ours.summary()["steps"] == 3


def test_telemetry_summary_and_check():
    _, ours = pair(telemetry=True)
    assert ours.summary()["steps"] == 0 and ours.summary()["last_overflow_step"] is None
    run = cases.train(ours, steps=12)
    summary = ours.summary()
    assert summary["steps"] == 12 and summary["skipped_steps"] == sum(run["skipped"])
    last = max(k for k, s in enumerate(run["skipped"]) if s)
    assert summary["last_overflow_step"] == last
    assert summary["scale_history"] == [cases.INIT_SCALE, *run["scales"]][4:12]
    assert summary["dynamic_scale"] == run["scales"][-1]
    assert set(summary) == {
        "dynamic_scale",
        "step_counter",
        "consecutive_skips",
        "steps",
        "skipped_steps",
        "last_overflow_step",
        "scale_history",
        "nonfinite_variables",
        "persistent_step",
        "last_step_skipped",
        "overflows",
    }
    assert summary["last_step_skipped"] is run["skipped"][-1]
    skipped = [k for k, s in enumerate(run["skipped"]) if s]
    assert [o["step"] for o in summary["overflows"]] == skipped[-8:]
    ours.check()  # no limits set: nothing to raise
    theirs, plain = pair()
    plain_run = cases.train(plain, steps=4)
    assert plain.summary() == {
        "dynamic_scale": 2.0**20,
        "step_counter": 0,
        "last_step_skipped": plain_run["skipped"][-1],
    }


def test_headroom_declines_a_growth_that_would_overflow_float16():
    def scales(growth_policy):
        scaler = lt.GradScaler(
            "cpu", init_scale=2.0**10, growth_interval=1, growth_policy=growth_policy
        )
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=1e-3)
        out = []
        for _ in range(3):
            (scaler.scale(p.sum()) * 2.0).backward()  # gradient 2 * scale
            scaler.step(opt)
            scaler.update()
            p.grad = None
            out.append(scaler.get_scale())
        return out

    assert scales("fixed") == [2.0**11, 2.0**12, 2.0**13]
    # Growing 2**11 would make the largest scaled gradient 2 * 2**12 = 8192,
    # past 65504 / 8: declined from then on.
    assert scales("headroom") == [2.0**11, 2.0**11, 2.0**11]


def _one_param_scaler(**kwargs):
    scaler = lt.GradScaler("cpu", init_scale=8.0, **kwargs)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    return scaler, p, torch.optim.SGD([p], lr=0.1)


@pytest.mark.parametrize("method", ["step", "unscale_", "update"])
def test_using_the_scaler_before_scale_is_a_clear_error(method):
    scaler, p, opt = _one_param_scaler()
    call = scaler.update if method == "update" else getattr(scaler, method)
    args = () if method == "update" else (opt,)
    with pytest.raises(RuntimeError, match=rf"`GradScaler.{method}\(\)` needs the loss scale"):
        call(*args)
    assert p.tolist() == [1.0, 1.0] and p.grad.tolist() == [1.0, 1.0]


def _torch_message(action):
    scaler = torch.amp.GradScaler("cpu")
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(torch.ones(()))
    p.grad = torch.ones(2)
    with pytest.raises((RuntimeError, ValueError)) as info:
        action(scaler, p, opt)
    return type(info.value), str(info.value)


def _unscale_twice(scaler, p, opt):
    scaler.unscale_(opt)
    scaler.unscale_(opt)


def _unscale_after_step(scaler, p, opt):
    scaler.step(opt)
    scaler.unscale_(opt)


def _step_twice(scaler, p, opt):
    scaler.step(opt)
    scaler.step(opt)


def _closure(scaler, p, opt):
    scaler.step(opt, closure=lambda: None)


def _half_gradients(scaler, p, opt):
    p.grad = torch.ones(2, dtype=torch.float16)
    scaler.unscale_(opt)


@pytest.mark.parametrize(
    "action", [_unscale_twice, _unscale_after_step, _step_twice, _closure, _half_gradients]
)
def test_stage_errors_are_torchs(action):
    scaler, p, opt = _one_param_scaler()
    scaler.scale(torch.ones(()))
    with pytest.raises((RuntimeError, ValueError)) as info:
        action(scaler, p, opt)
    assert (type(info.value), str(info.value)) == _torch_message(action)
    if action is _unscale_twice:
        assert "already been called" in str(info.value)


def test_update_without_a_step_is_a_clear_error():
    scaler, p, opt = _one_param_scaler()
    scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match=r"found no overflow check .* Call `scaler.step"):
        scaler.update()
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(init_scale=0.0), "`init_scale` must be a finite number > 0"),
        (dict(init_scale=float("inf")), "`init_scale` must be a finite number"),
        (dict(growth_factor=1.0), "`growth_factor` must be a finite number > 1"),
        (dict(backoff_factor=1.0), "`backoff_factor` must be a finite number > 0 and < 1"),
        (dict(growth_interval=0), "`growth_interval` must be an integer >= 1"),
        (dict(growth_interval=2.5), "`growth_interval` must be an integer >= 1"),
        (
            dict(enabled="yes"),
            "`enabled` must be a boolean \\(or 0 or 1\\). Received: enabled='yes'",
        ),
        (dict(hysteresis=0), "`hysteresis` must be an integer >= 1"),
        (dict(min_scale=2.0**20), "`init_scale` must lie between `min_scale` and `max_scale`"),
        (dict(max_scale=1.0), "`init_scale` must lie between `min_scale` and `max_scale`"),
        (dict(max_consecutive_skips=-1), "`max_consecutive_skips` must be an integer >= 0"),
        (
            dict(growth_policy="grow"),
            "`growth_policy` must be one of \\('fixed', 'headroom', 'statistics'\\)",
        ),
        (dict(telemetry=1), "`telemetry` must be a boolean"),
    ],
)
def test_constructor_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lt.GradScaler("cpu", **kwargs)


@pytest.mark.parametrize(
    "setter, value, message",
    [
        (
            "set_growth_factor",
            0.5,
            "`new_factor` must be a finite number > 1. Received: new_factor=0.5",
        ),
        ("set_backoff_factor", 1.5, "`new_factor` must be a finite number > 0 and < 1"),
        ("set_growth_interval", 0, "`new_interval` must be an integer >= 1"),
    ],
)
def test_setters_check_their_argument_and_change_nothing_on_error(setter, value, message):
    scaler = lt.GradScaler("cpu")
    before = (scaler.policy, scaler.get_growth_factor(), scaler.get_backoff_factor())
    with pytest.raises(ValueError, match=message):
        getattr(scaler, setter)(value)
    assert (scaler.policy, scaler.get_growth_factor(), scaler.get_backoff_factor()) == before


@pytest.mark.parametrize(
    "new_scale, message",
    [
        (torch.ones((), device="meta"), "on the scale's device \\(cpu\\) .* on meta"),
        (torch.ones(2), "one-element .* shape \\(2,\\)"),
        (torch.ones((), requires_grad=True), "does not require grad. .* requires_grad=True"),
        (torch.ones((), dtype=torch.int32), "floating-point .* dtype torch.int32"),
        (-1.0, "`new_scale` must be a finite number > 0"),
        (float("nan"), "`new_scale` must be a finite number > 0"),
        ("2", "`new_scale` must be a finite number > 0"),
    ],
)
def test_update_with_a_bad_new_scale_is_an_error_and_writes_nothing(new_scale, message):
    scaler, p, opt = _one_param_scaler()
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    with pytest.raises(ValueError, match=message):
        scaler.update(new_scale)
    assert scaler.get_scale() == 8.0
    scaler.update()  # the step's check is still there: nothing was cleared
    assert scaler.get_scale() == 8.0 and scaler._get_growth_tracker() == 1


def _counted_step_and_update(cls, steps, grads=None, **kwargs):
    """The aten operations of the last of `steps` fused-AdamW steps and updates, 16 parameters."""
    from tests.torch_cases import count_ops

    params = [torch.nn.Parameter(torch.randn(64, 32)) for _ in range(16)]
    opt = torch.optim.AdamW(params, fused=True)
    scaler = cls("cpu", **kwargs)
    scaler.scale(torch.ones(()))
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(64, 32) * 1024 if grads is None else grads.clone()
        with count_ops() as seen:
            scaler.step(opt)
            scaler.update()
    return seen, scaler


@pytest.mark.parametrize("steps", [1, 3])
def test_a_step_and_update_dispatch_torchs_operations(steps):
    # A plain policy's update is torch's kernel alone while the host's lower
    # bound of the scale shows a backoff cannot reach the floor.
    ours, _ = _counted_step_and_update(lt.GradScaler, steps, init_scale=1024.0)
    theirs, _ = _counted_step_and_update(torch.amp.GradScaler, steps, init_scale=1024.0)
    # The check's two 0-d operands: torch makes them (`full`) on every step,
    # ours once per device (`ones`, `zeros`: on the first step only).
    assert theirs[:2] == ["aten.full.default", "aten.full.default"]
    made = ["aten.ones.default", "aten.zeros.default"] if steps == 1 else []
    assert ours == made + theirs[2:]
    assert ours[-1] == "aten._amp_update_scale_.default"


@pytest.mark.parametrize(
    "init_scale, steps, floor_ops",
    [
        (4 * TINY, 3, ["aten.clamp_min_.default"]),  # the bound at the floor: one operation
        (4 * TINY, 1, []),  # a backoff cannot reach the floor yet: none
    ],
)
def test_the_floor_costs_operations_only_where_the_bound_is_near_it(init_scale, steps, floor_ops):
    # (A scale below 1 also checks the unscaled gradients: more operations before.)
    ours, scaler = _counted_step_and_update(lt.GradScaler, steps, init_scale=init_scale)
    update = ours[ours.index("aten._amp_update_scale_.default") :]
    assert update == ["aten._amp_update_scale_.default", *floor_ops]
    assert scaler.get_scale() >= min(init_scale, TINY)


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**-118, 3 * TINY])
def test_the_plain_update_follows_the_reference_rule(optimizer, init_scale):
    """The one-kernel update of a plain policy against `next_loss_scale`'s generic selects.

    `telemetry=True` takes the generic path (`_advance`). Overflows at
    random steps and in runs drive the scale to the floor and back up,
    through every tier of the host's bound (a fused optimizer never
    refreshes it; a non-fused one reads it each step), from a scale far
    above the floor, just above it and below it.
    """
    rng = np.random.default_rng(11)
    pattern = rng.random(400) < 0.45
    pattern[50:200] = True  # a run of overflows long enough to reach the floor from 2**16
    trails = []
    for extras in ({}, {"telemetry": True}):
        p = torch.nn.Parameter(torch.ones(8))
        opt = torch.optim.Adam([p], fused=optimizer == "fused", foreach=optimizer == "foreach")
        scaler = lt.GradScaler("cpu", init_scale=init_scale, growth_interval=3, **extras)
        trail = []
        for overflow in pattern:
            scaler.scale(torch.ones(()))
            p.grad = torch.full((8,), float("nan") if overflow else 1.0)
            scaler.step(opt)
            scaler.update()
            trail.append((scaler._scale.item(), scaler._growth_tracker.item()))
        trails.append(trail)
    assert trails[0] == trails[1]
    assert min(s for s, _ in trails[0][50:200]) == TINY  # the floor, reached
    assert max(s for s, _ in trails[0][200:]) > 2 * TINY  # and left
    assert scaler.last_step_skipped == bool(pattern[-1])


def _scaler(**kwargs):
    import lossscale.torch

    return lossscale.torch.GradScaler("cpu", **kwargs)


@pytest.mark.parametrize("enabled", [1, 0, True, False, np.bool_(True)])
def test_enabled_accepts_what_torch_accepts(enabled):
    ours, theirs = _scaler(enabled=enabled), torch.amp.GradScaler("cpu", enabled=enabled)
    assert ours.is_enabled() == theirs.is_enabled() == bool(enabled)
    loss = torch.tensor(3.0)
    assert float(ours.scale(loss)) == float(theirs.scale(loss))


@pytest.mark.parametrize("enabled", [2, -1, "yes", None, 1.0])
def test_enabled_refuses_other_values(enabled):
    with pytest.raises(ValueError, match=r"`enabled` must be a boolean \(or 0 or 1\)"):
        _scaler(enabled=enabled)


def test_a_tensor_init_scale_is_taken_as_torch_takes_it():
    ours = _scaler(init_scale=torch.tensor(8.0))
    theirs = torch.amp.GradScaler("cpu", init_scale=torch.tensor(8.0))
    loss = torch.tensor(3.0)
    assert float(ours.scale(loss)) == float(theirs.scale(loss)) == 24.0
    assert ours.get_scale() == theirs.get_scale() == 8.0
    with pytest.raises(
        ValueError, match=r"`init_scale` must be a positive number or a one-element"
    ):
        _scaler(init_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"init_scale"):
        _scaler(init_scale=torch.tensor(-8.0))


@pytest.mark.parametrize("bad", [-8.0, 0.0, float("nan"), float("inf")])
def test_a_tensor_new_scale_is_checked_as_a_float_is(bad):
    scaler = _scaler(init_scale=8.0)
    scaler.scale(torch.tensor(1.0))
    for new_scale in (bad, torch.tensor(bad)):
        with pytest.raises(ValueError, match=r"`new_scale` must be"):
            scaler.update(new_scale)
        assert scaler.get_scale() == 8.0  # nothing written
    scaler.update(torch.tensor(4.0))
    assert scaler.get_scale() == 4.0


def _one_step_at(cls, scale, grad, path):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=path == "fused", foreach=path != "fused")
    scaler = cls("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))
    p.grad = torch.tensor(grad)
    if path == "unscale_":
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return p.detach().clone(), scaler.get_scale()


@pytest.mark.parametrize("path", ["fused", "foreach", "unscale_"])
def test_a_gradient_that_overflows_only_when_unscaled_skips_the_step(path):
    """At a scale of 1/4 a gradient of 3e38 is finite, and 1.2e39 once unscaled."""
    theirs = _one_step_at(torch.amp.GradScaler, 0.25, [3e38, 1.0, -2.0], path)
    ours = _one_step_at(lt.GradScaler, 0.25, [3e38, 1.0, -2.0], path)
    assert not torch.isfinite(theirs[0]).all() and theirs[1] == 0.25  # torch steps with inf
    assert ours[0].tolist() == [1.0, 1.0, 1.0] and ours[1] == 0.125  # we skip and back off
    # Non-finite both before and after unscaling: one flag of 1 (a fused
    # kernel skips only on exactly 1), not the two checks' sum.
    for scale in (0.25, 4.0):
        params, new_scale = _one_step_at(lt.GradScaler, scale, [float("inf"), 1.0, 2.0], path)
        assert params.tolist() == [1.0, 1.0, 1.0] and new_scale == scale / 2


@pytest.mark.parametrize("how", ["backoffs", "new_scale", "load_state_dict"])
def test_the_guard_follows_a_scale_that_reached_below_one(how):
    """The host's bound on the scale follows backoffs and settings without reading it."""
    scaler = lt.GradScaler("cpu", init_scale=2.0)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    if how == "backoffs":  # 2 -> 1 -> 0.5
        for _ in range(2):
            scaler.scale(torch.ones(()))
            p.grad = torch.full((3,), float("nan"))
            scaler.step(opt)
            scaler.update()
    else:
        scaler.scale(torch.ones(()))
        if how == "new_scale":
            p.grad = torch.ones(3)
            scaler.step(opt)
            scaler.update(new_scale=0.5)
        else:
            scaler.load_state_dict({**scaler.state_dict(), "scale": 0.5})
    scaler.scale(torch.ones(()))
    p.grad = torch.tensor([3e38, 1.0, 2.0])
    before = p.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), before) and scaler.get_scale() == 0.25


def test_ordinary_gradients_at_a_scale_below_one_match_torch():
    """Below 1 the extra check runs; without an overflow it changes nothing."""
    for kind in ("fused", "foreach"):
        theirs, ours = (
            cls("cpu", init_scale=2.0**-3, growth_interval=4)
            for cls in (torch.amp.GradScaler, lt.GradScaler)
        )
        a, b = cases.train(theirs, kind, steps=10), cases.train(ours, kind, steps=10)
        assert a["scales"] == b["scales"] and not any(a["skipped"])
        assert cases.same_weights(a["params"], b["params"])


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_after_a_crossed_limit_finite_steps_are_skipped_too(kind):
    scaler = lt.GradScaler("cpu", init_scale=8.0, max_consecutive_skips=1)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=0.1, fused=kind == "fused", foreach=kind != "fused")
    for k, grad in enumerate((float("nan"), float("nan"), 1.0, 1.0)):
        scaler.scale(torch.ones(()))
        p.grad = torch.full((2,), grad)
        scaler.step(opt)
        if k == 0:
            scaler.update()
            continue
        with pytest.raises(lossscale.LossScaleError, match="Loss scaling failed at step 1"):
            scaler.update()
    # Caught and continued: the state stays as it was at the failure, and
    # finite steps are skipped until the state is restored.
    assert p.tolist() == [1.0, 1.0] and scaler.get_scale() == 2.0
    assert scaler.summary()["steps"] == 2
    scaler.load_state_dict(lt.GradScaler("cpu", init_scale=8.0).state_dict())
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    assert p.tolist() != [1.0, 1.0]


def test_process_group_without_torch_distributed_fails_before_unscaling():
    scaler = lt.GradScaler("cpu", init_scale=8.0, process_group=object())
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(torch.ones(()))
    p.grad = torch.full((2,), 4.0)
    message = (
        r"^`process_group` was given but torch.distributed is not initialised: call "
        r"`torch.distributed.init_process_group` before stepping. Received: "
        r"process_group=<object object at 0x[0-9a-f]+>$"
    )
    with pytest.raises(ValueError, match=message):
        scaler.step(opt)
    assert p.grad.tolist() == [4.0, 4.0]  # still scaled


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
    assert str(info.value).startswith(
        "Loss scaling failed at step 1: nonfinite_loss: the loss itself was NaN or inf at step 1"
    )
    assert "  step 1: nonfinite_loss, loss NaN/inf; non-finite: " in str(info.value)


def test_an_overflow_error_names_the_module_and_the_parameters():
    model = injected_model()
    scaler = lt.GradScaler("cpu", init_scale=2.0**16, max_consecutive_skips=1)
    lt.watch(model, scaler)
    with pytest.raises(ls.LossScaleError) as info:
        scaled_steps(scaler, model, optimizer_for(model, "fused"), steps=3)
    message = str(info.value)
    assert message.startswith("Loss scaling failed at step 1: overflow: gradients of ")
    assert "  steps 0-1: overflow, loss finite; starting in module 'encoder.linear2'" in message


# Both sides of 4096 and of 2**18 elements.
RANGE_SIZES = (4095, 4097, 2**18 - 1, 2**18 + 1)


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
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in RANGE_SIZES])
    names = [f"p{i}" for i in range(len(RANGE_SIZES))]
    optimizer = torch.optim.AdamW(
        [{"params": list(params), "param_names": names}],
        fused=kind == "fused",
        foreach=kind != "fused",
    )
    scaler = lt.GradScaler("cpu", growth_factor=growth_factor, diagnostics_every=3)
    scaler.scale(torch.ones(()))
    expected = {}
    for step in range(4):
        grads = [scaled_gradient(rng, n, growth_factor) for n in RANGE_SIZES]
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


# Both sides of torch's CPU kernels' vector width and of lossscale's packing
# sizes, and a tensor past 1M elements, odd.
SIZES = (1, 7, 8, 9, 64, 4097, 65537, 1_048_579)


SCALE = 2.0**16


SETTINGS = {
    "momentum": dict(momentum=0.9),
    "dampening": dict(momentum=0.9, dampening=0.25, weight_decay=1e-2),
    "nesterov": dict(momentum=0.8, nesterov=True),
}


def _params():
    rng = np.random.default_rng(0)
    return [
        torch.nn.Parameter(torch.from_numpy(rng.uniform(-1, 1, n).astype(np.float32)))
        for n in SIZES
    ]


def _grads(steps, bad_steps, seed):
    """Per step, one gradient per parameter; on `bad_steps` one bad value somewhere."""
    rng = np.random.default_rng(seed)
    runs = []
    for step in range(steps):
        grads = [torch.from_numpy(rng.normal(0, 1e-2, n).astype(np.float32)) for n in SIZES]
        if step in bad_steps:
            tensor = int(rng.integers(len(SIZES)))
            where = [0, SIZES[tensor] - 1, int(rng.integers(SIZES[tensor]))][step % 3]
            grads[tensor][where] = [np.nan, np.inf, -np.inf][int(rng.integers(3))]
        runs.append(grads)
    return runs


def _sgd(params, settings):
    return torch.optim.SGD(params, lr=0.1, fused=True, **SETTINGS[settings])


def _train(scaler, opt, params, runs, unscale_first=False):
    for grads in runs:
        scaler.scale(torch.ones(()))  # creates the scale, as a forward pass does
        scale = scaler.get_scale()
        for p, g in zip(params, grads):
            p.grad = g * scale
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_ then step"])
@pytest.mark.parametrize("overflows", [1, 3])
@pytest.mark.parametrize("settings", list(SETTINGS))
def test_first_steps_that_overflow_leave_fused_sgd_as_if_they_never_ran(
    settings, overflows, unscale_first
):
    runs = _grads(3 + overflows, bad_steps=range(overflows), seed=overflows)
    ours = _params()
    opt = _sgd(ours, settings)
    scaler = lt.GradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
    _train(scaler, opt, ours, runs[:overflows], unscale_first)
    # Nothing was made: torch's kernel would have stored uninitialised buffers.
    assert len(opt.state) == 0
    assert all(torch.equal(p, q) for p, q in zip(ours, _params()))
    assert scaler.get_scale() == SCALE / 2**overflows
    _train(scaler, opt, ours, runs[overflows:], unscale_first)

    theirs = _params()
    twin = _sgd(theirs, settings)
    reference = torch.amp.GradScaler("cpu", init_scale=SCALE / 2**overflows, growth_interval=10**6)
    _train(reference, twin, theirs, runs[overflows:], unscale_first)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], twin.state[q]["momentum_buffer"])
    assert scaler.get_scale() == reference.get_scale()


def test_skipped_first_step_makes_no_state():
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    scaler = lt.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.ones(()))
    for p, g in zip(params, _grads(1, bad_steps=[0], seed=5)[0]):
        p.grad = g
    assert scaler.step(opt) is None
    assert len(opt.state) == 0
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)  # torch's stage error, unchanged
    scaler.update()
    assert scaler.get_scale() == SCALE / 2


def test_torchs_own_scaler_keeps_buffers_that_no_kernel_filled():
    """The flaw `scaler_step` works around (torch 2.13): if this fails, torch fixed it."""
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.ones(()))
    for p, g in zip(params, _grads(1, bad_steps=[0], seed=5)[0]):
        p.grad = g
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == SCALE / 2  # skipped ...
    assert all("momentum_buffer" in opt.state[p] for p in params)  # ... yet buffers were kept


def test_after_the_first_applied_step_fused_sgd_steps_without_host_reads():
    params = _params()
    scaler = lt.GradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
    runs = _grads(4, bad_steps=[2], seed=7)
    opt = _sgd(params, "momentum")
    _train(scaler, opt, params, runs[:1])
    before = [opt.state[p]["momentum_buffer"].clone() for p in params]
    with no_host_reads():  # the flag goes to the kernel as a device tensor
        for grads in runs[1:]:
            scaler.scale(torch.ones(()))
            for p, g in zip(params, grads):
                p.grad = g * SCALE
            scaler.step(opt)
            scaler.update()
    assert not any(torch.equal(b, opt.state[p]["momentum_buffer"]) for b, p in zip(before, params))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),  # no momentum: no buffer
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),  # read anyway
        lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),  # its state starts at zeros
    ],
    ids=["sgd fused", "sgd momentum foreach", "adamw fused"],
)
def test_other_optimizers_step_as_under_torchs_scaler(make):
    runs = _grads(4, bad_steps=[0, 2], seed=11)
    results = []
    for cls in (torch.amp.GradScaler, lt.GradScaler):
        params = _params()
        opt = make(params)
        scaler = cls("cpu", init_scale=SCALE, growth_interval=10**6)
        for grads in runs:
            scaler.scale(torch.ones(()))
            for p, g in zip(params, grads):
                p.grad = g * scaler.get_scale()
            scaler.step(opt)
            scaler.update()
        results.append((params, scaler.get_scale()))
    (theirs, their_scale), (ours, our_scale) = results
    assert our_scale == their_scale == SCALE / 4
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))


@pytest.mark.parametrize("backoff_factor", [0.5, 0.3, 0.9])
def test_the_bound_stays_at_or_below_the_scale_through_overflows(backoff_factor):
    """A GradScaler whose gradients overflow at random steps, factors that round in float32."""
    rng = np.random.default_rng(int(backoff_factor * 10))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = lt.GradScaler(
        "cpu", init_scale=2.0**20, backoff_factor=backoff_factor, growth_interval=3
    )
    for _ in range(60):
        x = torch.ones(2, 4)
        if rng.random() < 0.5:
            x[0, 0] = np.inf
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler._scale_bound <= float(scaler.get_scale())


@pytest.mark.parametrize("telemetry", [False, True])
def test_the_last_step_s_skip_is_in_the_summary(telemetry):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = lt.GradScaler("cpu", init_scale=2.0**10, telemetry=telemetry)
    assert scaler.summary()["last_step_skipped"] is False  # before the first update
    x = torch.randn(32, 256)
    seen = []
    for bad in (False, True, False):
        optimizer.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if bad:  # an inf at a random element of the largest gradient
            flat = model[0].weight.grad.view(-1)
            flat[int(torch.randint(flat.numel(), ()))] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        seen.append(scaler.summary()["last_step_skipped"])
    assert seen == [False, True, False]


def _mlp(depth):
    """A float32 MLP of `depth` Linear layers (2 * depth parameters), seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(depth)])


@pytest.mark.parametrize("where", ["weight", "hook", "loss"])
def test_the_cause_of_each_skip_and_a_persistent_one(where):
    from lossscale.mixed_precision import PersistentSkipWarning

    model = _mlp(3)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-3)
    scaler = lt.GradScaler("cpu", init_scale=2.0**4, telemetry=True)
    x = torch.randn(64, 24)
    if where == "hook":
        params[2].register_hook(lambda g: g * float("nan"))
    for step in range(8):
        if where == "weight" and step == 2:
            with torch.no_grad():
                params[0][3, 5] = float("nan")
        loss = model(x).square().mean()
        if where == "loss" and step >= 2:
            loss = loss * float("nan")
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.update()
            summary = scaler.summary()
        if summary["persistent_step"] is not None:
            assert [w.category for w in caught] == [PersistentSkipWarning]
            break
    causes = [o["cause"] for o in summary["overflows"]]
    # The loss is NaN where the weight or the loss is; a hook's NaN leaves it finite.
    before = "overflow" if where == "hook" else "nonfinite_loss"
    assert causes[-1] == "persistent" and set(causes[:-1]) == {before}, causes
    assert summary["overflows"][-1]["variables"] == (
        ["group0.param2"] if where == "hook" else [f"group0.param{i}" for i in range(6)]
    )


def test_on_persistent_raise_stops_at_that_update():
    model = _mlp(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lt.GradScaler("cpu", init_scale=2.0**3, on_persistent="raise")
    list(model.parameters())[1].register_hook(lambda g: g * float("nan"))
    with pytest.raises(lossscale.mixed_precision.LossScaleError) as info:
        for _ in range(10):
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(8, 24)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
    assert str(info.value).startswith(
        "Loss scaling: step 3 was skipped, persistent: the same 1 variable (group0.param1) stayed "
        "non-finite through back-offs since step 0, down to scale 1"
    )


def test_a_nan_loss_error_is_short_on_a_148_parameter_model():
    model = _mlp(74)
    names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lt.GradScaler("cpu", max_consecutive_skips=2)
    lt.watch(model, scaler)
    with pytest.raises(lossscale.mixed_precision.LossScaleError) as info:
        for _ in range(4):
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(8, 24)).sum() * float("nan")).backward()
            scaler.step(optimizer)
            scaler.update()
    message = str(info.value)
    assert len(names) == 148 and len(message) <= 4000, len(message)
    first = message.splitlines()[0]
    assert first.startswith(
        "Loss scaling failed at step 2: nonfinite_loss: the loss itself was NaN or inf at step 2"
    )
    # Three names, then a count: "148 variables (0.weight, 0.bias, 1.weight and 145 more)".
    assert f"148 variables ({names[0]}, {names[1]}, {names[2]} and 145 more)" in message


def test_scale_misuse_is_refused_or_warned():
    from lossscale.mixed_precision import ScaleMismatchWarning

    with pytest.raises(ValueError, match=r"^`init_scale` must be at least 2\*\*-126"):
        lt.GradScaler("cpu", init_scale=1e-45)
    scaler = lt.GradScaler("cpu")
    with pytest.raises(TypeError, match=r"^`outputs` must be .* Received: .*str"):
        scaler.scale("loss")
    model = _mlp(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(8, 24)).sum()
    with pytest.warns(ScaleMismatchWarning, match="the loss was scaled twice"):
        scaler.scale(scaler.scale(loss)).backward()
    scaler.step(optimizer)
    scaler.update()
    # The scale set between scaling and stepping: another scaler, warned once there.
    other = lt.GradScaler("cpu")
    optimizer.zero_grad()
    other.scale(model(torch.randn(8, 24)).sum()).backward()
    other.update(2.0**9)
    with pytest.warns(ScaleMismatchWarning, match="the scale changed between scaling the loss"):
        other.step(optimizer)


def _poisoned_run(scaler, kind, poison, steps=8):
    """`(scales, weights)` of a few steps; `poison(step, named, scale)` edits the scaled gradients."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"embed": torch.nn.Embedding(4096, 80), "head": torch.nn.Linear(80, 16)}
    )  # 327,680 values in the largest gradient
    fused = kind == "fused"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
    scales = []
    for step in range(steps):
        tokens = torch.randint(0, 4096, (64,))
        loss = model["head"](model["embed"](tokens)).square().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        poison(step, dict(model.named_parameters()), scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


def _poison(huge, expected):
    """Puts inf/NaN at the edges and at random positions (and 3e38 at step 6 if `huge`).

    Records in `expected` the non-finite parameters of each step by the
    float64 reference: inf or NaN scaled, or beyond float32 once unscaled.
    """
    rng = np.random.default_rng(7)
    hits = {1: [("embed.weight", 0)], 3: [("embed.weight", -1), ("head.bias", 5)]}
    hits[5] = [("head.weight", None), ("embed.weight", None)]  # random positions
    hits[6] = [("head.weight", None)] if huge else []
    values = {1: math.inf, 3: math.nan, 5: -math.inf, 6: 3e38}

    def poison(step, named, scale):
        for name, at in hits.get(step, []):
            flat = named[name].grad.view(-1)
            flat[int(rng.integers(flat.numel())) if at is None else at] = values[step]
        with np.errstate(over="ignore"):
            bad = [
                name
                for name, p in named.items()
                if not np.isfinite(np.float32(np.abs(p.grad.double().numpy()).max() / scale))
            ]
        if bad:
            expected[step] = sorted(bad)

    return poison


@pytest.mark.parametrize("kind", ["fused", "foreach"])
@pytest.mark.parametrize("init_scale", [2.0**10, 2.0**-3])
def test_telemetry_flags_each_gradient_in_torchs_own_check(kind, init_scale):
    """On CPU each parameter's flag comes from torch's check, one gradient per call.

    torch's weights and scales bit for bit, and the overflow records of the
    float64 reference; below scale 1 a finite gradient that overflows once
    unscaled is flagged too (ours skips that step, torch's applies it: it is
    compared to the reference only).
    """
    ours = lt.GradScaler("cpu", init_scale=init_scale, growth_interval=3, telemetry=True)
    theirs = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3)
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lossscale.PersistentSkipWarning)
        b = _poisoned_run(ours, kind, _poison(init_scale < 1, expected))
        a = _poisoned_run(theirs, kind, _poison(False, {}))
        records = ours.summary()["overflows"]
    names = {"group0.param0": "embed.weight", "group0.param1": "head.weight"}
    names["group0.param2"] = "head.bias"
    assert {r["step"]: sorted(names[v] for v in r["variables"]) for r in records} == expected
    assert set(expected) == ({1, 3, 5, 6} if init_scale < 1 else {1, 3, 5})
    if init_scale >= 1:
        assert a[0] == b[0] and cases.same_weights(a[1], b[1])
