"""`lossscale.torch.GradScaler` against `torch.amp.GradScaler`, bit for bit.

The shared loop (tests/grad_scaler_cases.py) is a float16-autocast
transformer whose first steps overflow; every comparison runs it with
torch's scaler and with ours. The guards where ours differs (a gradient that
overflows only once unscaled, fail-fast skips) are in test_scaler_checks.py,
state dicts in test_scaler_host.py,
Lightning, Accelerate and torch.distributed in test_grad_scaler_ecosystem.py.
"""

import doctest
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import lossscale
import lossscale.torch as lt
from tests import grad_scaler_cases as cases

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


# -- the same training run as torch's -----------------------------------------


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


# -- where our guards differ from torch's ---------------------------------------


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


# -- no host reads beyond torch's ------------------------------------------------

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


# -- the extras on the loop --------------------------------------------------------


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
    assert "Loss scaling failed at step 3: the loss scale would fall below `min_scale`" in message
    assert "min_scale=2097152.0" in message and "in total: 4 of 4" in message
    # The parameters are named (by their place in the param groups, here).
    assert "Variables whose gradients were non-finite at that step: ['group0.param" in message
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
        "overflows",
    }
    skipped = [k for k, s in enumerate(run["skipped"]) if s]
    assert [o["step"] for o in summary["overflows"]] == skipped[-8:]
    ours.check()  # no limits set: nothing to raise
    theirs, plain = pair()
    cases.train(plain, steps=4)
    assert plain.summary() == {"dynamic_scale": 2.0**20, "step_counter": 0}


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


# -- bad input ------------------------------------------------------------------


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
        # Below it: floored on overflow only; the first backoff reaches the
        # floor, and the bound (read while the scale is below 1) follows.
        (1e-40, 1, ["aten.mul.Tensor", "aten.clamp_min_.Tensor"]),
        (1e-40, 2, ["aten.clamp_min_.default"]),
    ],
)
def test_the_floor_costs_operations_only_where_the_bound_is_near_it(init_scale, steps, floor_ops):
    # (A scale below 1 also checks the unscaled gradients: more operations before.)
    ours, scaler = _counted_step_and_update(lt.GradScaler, steps, init_scale=init_scale)
    update = ours[ours.index("aten._amp_update_scale_.default") :]
    assert update == ["aten._amp_update_scale_.default", *floor_ops]
    assert scaler.get_scale() >= min(init_scale, TINY)


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**-118, 3 * TINY, 1e-40])
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


# --- lossscale.torch.GradScaler: what torch's scaler accepts, checked alike --------


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


def test_unscale_grads_before_scale_is_a_clear_error():
    scaler = _scaler()
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    opt = torch.optim.SGD([param], lr=0.1)
    found_inf = torch.zeros(1)
    with pytest.raises(
        RuntimeError, match=r"`GradScaler._unscale_grads_\(\)` needs the loss scale"
    ):
        scaler._unscale_grads_(opt, torch.ones(()), found_inf, False)
    assert torch.equal(param.grad, torch.ones(3))
