"""`LossScaleOptimizer`'s diagnosis, on every backend: why each step was skipped, a scale used twice.

Each skipped step's cause in `summary()["overflows"]` and `LossScaleError`'s
first line (`"nonfinite_loss"`, `"overflow"`, `"persistent"`),
`on_persistent`, `ScaleMismatchWarning`, and the one validation of state
that comes back in through `load_state_dict`, `load_own_variables` and
`set_weights`. On torch also a real model whose weight, gradient hook or
loss turns NaN.
"""

import warnings

import numpy as np
import pytest

import lossscale as ls
from lossscale.mixed_precision import (
    LossScaleError,
    PersistentSkipWarning,
    ScaleMismatchWarning,
    UnscaledLossWarning,
)

SHAPES = [(64, 33), (4097,), (7,)]


def _model(backend, rng, **settings):
    variables = [
        ls.Variable(backend.array(rng.standard_normal(s).astype(np.float32)), name=f"v{i}")
        for i, s in enumerate(SHAPES)
    ]
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), **settings)
    opt.build(variables)
    return variables, opt


def _grads(backend, rng, scale, bad=(), value=np.nan):
    grads = [(rng.standard_normal(s) * scale).astype(np.float32) for s in SHAPES]
    for i in bad:
        flat = grads[i].reshape(-1)
        flat[int(rng.integers(flat.size))] = value
    return [backend.array(g) for g in grads]


def _step(backend, rng, opt, variables, loss=1.0, bad=(), value=np.nan):
    scaled = opt.scale_loss(backend.array(np.float32(loss)))
    del scaled
    opt.apply(_grads(backend, rng, float(opt.dynamic_scale), bad, value), variables)


def test_a_nan_loss_is_recorded_as_nonfinite_loss(backend, rng):
    variables, opt = _model(backend, rng, initial_scale=2.0**10, telemetry=True)
    _step(backend, rng, opt, variables)
    _step(backend, rng, opt, variables, loss=np.nan, bad=(0, 1, 2))
    (overflow,) = opt.summary()["overflows"]
    assert (overflow["step"], overflow["cause"], overflow["loss_finite"]) == (
        1,
        "nonfinite_loss",
        False,
    )


def test_an_overflow_at_a_huge_scale_is_an_overflow_said_to_be_too_high(backend, rng):
    variables, opt = _model(backend, rng, initial_scale=2.0**40, max_consecutive_skips=0)
    with pytest.raises(LossScaleError) as info:
        _step(backend, rng, opt, variables, bad=(0, 1, 2), value=np.inf)
    (overflow,) = opt.summary()["overflows"]
    assert (overflow["cause"], overflow["loss_finite"]) == ("overflow", True)
    assert str(info.value).startswith(
        "Loss scaling failed at step 0: overflow: every variable's gradient was non-finite at "
        "step 0 while the loss was finite: the scale (1.09951e+12) is too high for this loss."
    )


def test_a_gradient_nan_through_six_steps_is_persistent(backend, rng):
    # 2**5 halved five times reaches 1: the sixth skip is one no back-off can clear.
    variables, opt = _model(backend, rng, initial_scale=2.0**5, telemetry=True)
    with pytest.warns(PersistentSkipWarning, match=r"step 5 was skipped, persistent: the same 1"):
        for _ in range(6):
            _step(backend, rng, opt, variables, bad=(1,))
        summary = opt.summary()  # "warn": at the next host read
    causes = [o["cause"] for o in summary["overflows"]]
    assert causes == ["overflow"] * 5 + ["persistent"]
    assert summary["persistent_step"] == 5 and summary["overflows"][-1]["variables"] == ["v1"]


def test_a_new_variable_going_bad_is_not_persistent(backend, rng):
    variables, opt = _model(backend, rng, initial_scale=2.0**5, telemetry=True)
    for step in range(7):
        # v1 from the start, v2 joins at the last step: not the same variables.
        _step(backend, rng, opt, variables, bad=(1,) if step < 6 else (1, 2))
    causes = [o["cause"] for o in opt.summary()["overflows"]]
    assert causes[-2:] == ["persistent", "overflow"]


@pytest.mark.parametrize("on_persistent", ["raise", "callable"])
def test_on_persistent_acts_right_after_that_step(backend, rng, on_persistent):
    seen = []
    hook = "raise" if on_persistent == "raise" else seen.append
    # Without `telemetry`: "raise" and a callable turn it on.
    variables, opt = _model(backend, rng, initial_scale=2.0**5, on_persistent=hook)
    assert opt.telemetry
    for _ in range(5):
        _step(backend, rng, opt, variables, bad=(2,))
    if on_persistent == "raise":
        with pytest.raises(LossScaleError, match="step 5 was skipped, persistent"):
            _step(backend, rng, opt, variables, bad=(2,))
        _step(backend, rng, opt, variables, bad=(2,))  # once
    else:
        _step(backend, rng, opt, variables, bad=(2,))
        assert len(seen) == 1 and seen[0]["persistent_step"] == 5


def test_a_loss_scaled_twice_warns(backend, rng):
    variables, opt = _model(backend, rng, initial_scale=2.0**10)
    # Per-example losses: NumPy turns a 0-d product into a scalar, which has no identity.
    loss = backend.array(np.float32([0.5, 0.25]))
    with pytest.warns(ScaleMismatchWarning, match="the loss was scaled twice"):
        opt.scale_loss(opt.scale_loss(loss))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per optimizer
        opt.scale_loss(opt.scale_loss(loss))
        opt.apply(_grads(backend, rng, 2.0**10), variables)


def test_a_scale_changed_between_scaling_and_applying_warns(backend, rng):
    variables, opt = _model(backend, rng, initial_scale=2.0**10)
    saved = opt.state_dict()
    _step(backend, rng, opt, variables)
    opt.scale_loss(backend.array(np.float32(0.5)))
    opt.load_state_dict(saved)  # the loss was scaled by the scale before the load
    with pytest.warns(ScaleMismatchWarning, match="the scale changed between scaling the loss"):
        opt.apply(_grads(backend, rng, 2.0**10), variables)


def test_a_failing_apply_keeps_the_unscaled_loss_warning(backend, rng):
    variables, opt = _model(backend, rng)
    with pytest.raises(ValueError, match="5 gradients for 3 variables"):
        opt.apply(_grads(backend, rng, 1.0) + _grads(backend, rng, 1.0)[:2], variables)
    with pytest.warns(UnscaledLossWarning):
        opt.apply(_grads(backend, rng, 1.0), variables)


@pytest.mark.parametrize(
    "key, value, shown, rule",
    [
        ("dynamic_scale", np.nan, "nan", "a normal float32 number > 0"),
        ("dynamic_scale", np.inf, "inf", "a normal float32 number > 0"),
        ("dynamic_scale", 0.0, "0.0", "a normal float32 number > 0"),
        ("dynamic_scale", -4.0, "-4.0", "a normal float32 number > 0"),
        ("step_counter", 3.7, "3.7", "an integer >= 0"),
        ("adam/iteration", -1, "-1", "an integer >= 0"),
    ],
)
def test_a_state_dict_no_step_could_leave_is_refused_and_nothing_loaded(
    backend, rng, key, value, shown, rule
):
    variables, opt = _model(backend, rng, initial_scale=2.0**10)
    _step(backend, rng, opt, variables)
    saved = opt.state_dict()
    before = [backend.numpy(v).copy() for v in opt.variables]
    path = key if key.startswith("adam/") else f"loss_scale_optimizer/{key}"
    bad = dict(saved["optimizer_variables"])
    bad[path] = np.asarray(
        value, np.float32 if "." in shown or shown in ("nan", "inf") else np.int32
    )
    with pytest.raises(
        ValueError,
        match=rf"^`state_dict\['optimizer_variables'\]\['{path}'\]` holds {shown}(\d*), but .* "
        rf"must be {rule}",
    ):
        opt.load_state_dict({**saved, "optimizer_variables": bad})
    for b, v in zip(before, opt.variables):
        np.testing.assert_array_equal(backend.numpy(v), b)
    store = {}
    opt.save_own_variables(store)
    index = [v.path for v in opt.variables].index(path)
    store[str(index)] = bad[path]
    with pytest.raises(ValueError, match=rf"^`store\['{index}'\]` holds {shown}"):
        opt.load_own_variables(store)
    with pytest.raises(ValueError, match=rf"^`weights\[{index}\]` holds {shown}"):
        opt.set_weights([store[str(i)] for i in range(len(store))])
    for b, v in zip(before, opt.variables):
        np.testing.assert_array_equal(backend.numpy(v), b)


def test_a_subnormal_initial_scale_is_refused():
    with pytest.raises(ValueError, match=r"^`initial_scale` must be at least 2\*\*-126"):
        ls.LossScaleOptimizer(ls.optimizers.SGD(0.1), initial_scale=1e-45)


def test_a_string_loss_is_refused_naming_its_type(rng):
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.1))
    with pytest.raises(
        TypeError, match=r"^`loss` must be a number or an array .* Received: loss of type str$"
    ):
        opt.scale_loss("loss")


@pytest.mark.parametrize("where", ["weight", "hook", "loss"])
def test_a_torch_model_turned_nan_is_found_persistent(where):
    """A NaN in a weight, from a gradient hook, or in the loss: skipped, then persistent."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    params = list(model.parameters())
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), initial_scale=2.0**4, telemetry=True)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    if where == "hook":
        params[2].register_hook(lambda g: g * float("nan"))
    for step in range(8):
        if where == "weight" and step == 2:
            with torch.no_grad():
                params[0][3, 5] = float("nan")
        loss = torch.nn.functional.mse_loss(model(x), y)
        if where == "loss" and step >= 2:
            loss = loss * float("nan")
        opt.scale_loss(loss).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PersistentSkipWarning)
            opt.apply([p.grad for p in params], params)
        model.zero_grad(set_to_none=True)
    summary = opt.summary()
    causes = [o["cause"] for o in summary["overflows"]]
    assert "persistent" in causes, causes
    assert summary["persistent_step"] is not None
    if where != "hook":  # the loss is NaN too: its first skips say so
        assert causes[0] == "nonfinite_loss"


def test_the_last_step_s_skip_is_in_the_summary_without_telemetry(backend, rng):
    variables, opt = _model(backend, rng, initial_scale=2.0**10)
    assert opt.summary()["last_step_skipped"] is False  # no step yet
    seen = []
    for bad in ((), (1,), (0, 2), ()):
        _step(backend, rng, opt, variables, bad=bad, value=np.inf)
        seen.append(opt.summary()["last_step_skipped"])
    assert seen == [False, True, True, False]
    assert sorted(opt.summary()) == ["dynamic_scale", "last_step_skipped", "step_counter"]
