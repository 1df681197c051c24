"""`GradScaler`'s extra state (lossscale/torch/scaler_state.py): state dicts, pickling, summaries."""

import copy
import io
import pickle

import pytest
import torch

import lossscale.torch as lt
from tests import grad_scaler_cases as cases

SETTINGS = dict(init_scale=cases.INIT_SCALE, growth_interval=cases.GROWTH_INTERVAL)
HALF = cases.STEPS // 2


def uninterrupted(cls, **extras):
    return cases.train(cls("cpu", **SETTINGS, **extras))


def resumed(first, second_cls, load_before_first_step=True, **extras):
    """Half the loop with scaler `first`, the rest with a new one loaded from its state dict."""
    run = cases.train(first, steps=HALF)
    state = first.state_dict()
    second = second_cls("cpu", **extras)  # defaults: the state dict brings torch's settings
    if not load_before_first_step:
        second.scale(torch.ones(()))
    second.load_state_dict(state)
    rest = cases.train(
        second, steps=cases.STEPS - HALF, model=run["model"], optimizer=run["optimizer"]
    )
    return run["scales"] + rest["scales"], rest["params"], second


@pytest.mark.parametrize(
    "first, second",
    [
        (lt.GradScaler, lt.GradScaler),
        (lt.GradScaler, torch.amp.GradScaler),
        (torch.amp.GradScaler, lt.GradScaler),
    ],
)
@pytest.mark.parametrize("before", [True, False])
def test_state_dict_round_trips_continue_the_run_exactly(first, second, before):
    reference = uninterrupted(torch.amp.GradScaler)
    scales, params, _ = resumed(first("cpu", **SETTINGS), second, before)
    assert scales == reference["scales"]
    assert cases.same_weights(params, reference["params"])


def test_our_state_dict_is_torchs_plus_the_extra_fields():
    theirs, ours = torch.amp.GradScaler("cpu", **SETTINGS), lt.GradScaler("cpu", **SETTINGS)
    cases.train(theirs, steps=7)
    cases.train(ours, steps=7)
    assert ours.state_dict() == theirs.state_dict()
    detailed = lt.GradScaler("cpu", **SETTINGS, hysteresis=2, telemetry=True)
    cases.train(detailed, steps=7)
    state = detailed.state_dict()
    assert set(state) == set(theirs.state_dict()) | {"lossscale"}
    assert set(state["lossscale"]) == {
        "consecutive_skips",
        "steps",
        "skipped_steps",
        "last_overflow_step",
        "scale_history",
        "streak_scale",
        "persistent_step",
        "loss_finite",
        "overflow_steps",
        "overflow_loss",
        "overflow_cause",
    }
    assert state["lossscale"]["steps"] == 7


def test_extra_fields_survive_torch_save_and_load_before_the_first_step():
    extras = dict(hysteresis=2, telemetry=True, max_consecutive_skips=20)
    reference = uninterrupted(lt.GradScaler, **extras)
    first = lt.GradScaler("cpu", **SETTINGS, **extras)
    run = cases.train(first, steps=HALF)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = lt.GradScaler("cpu", **extras)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    # Before any scale(): from the loaded values. The per-parameter records
    # are not in a state dict: the loaded window names no parameters.
    loaded, saved = second.summary(), first.summary()
    assert loaded["nonfinite_variables"] == [] and saved["nonfinite_variables"] != []
    assert all(o["variables"] == [] for o in loaded["overflows"])
    saved["overflows"] = [{**o, "variables": []} for o in saved["overflows"]]
    saved["nonfinite_variables"] = []
    assert loaded == saved
    rest = cases.train(
        second, steps=cases.STEPS - HALF, model=run["model"], optimizer=run["optimizer"]
    )
    assert run["scales"] + rest["scales"] == reference["scales"]
    assert cases.same_weights(rest["params"], reference["params"])
    assert second.summary()["steps"] == cases.STEPS


def test_fields_a_dict_lacks_start_afresh_and_untracked_ones_are_ignored():
    plain = lt.GradScaler("cpu", **SETTINGS)
    cases.train(plain, steps=5)
    detailed = lt.GradScaler("cpu", telemetry=True)
    detailed.load_state_dict(plain.state_dict())
    summary = detailed.summary()
    assert summary["dynamic_scale"] == plain.get_scale() and summary["steps"] == 0
    tracking = lt.GradScaler("cpu", **SETTINGS, telemetry=True)
    cases.train(tracking, steps=5)
    plain.load_state_dict(tracking.state_dict())
    assert plain.summary() == {
        "dynamic_scale": tracking.get_scale(),
        "step_counter": 0,
        "last_step_skipped": False,  # no step since the load
    }


def test_deepcopy_and_pickle_between_iterations():
    scaler = lt.GradScaler("cpu", **SETTINGS, telemetry=True)
    run = cases.train(scaler, steps=HALF)
    clone = pickle.loads(pickle.dumps(scaler))
    twin = copy.deepcopy(scaler)
    for copied in (clone, twin):
        assert copied.summary() == scaler.summary() and copied.policy == scaler.policy
    model, optimizer = copy.deepcopy((run["model"], run["optimizer"]))  # one memo: shared params
    a = cases.train(scaler, steps=4, model=run["model"], optimizer=run["optimizer"])
    b = cases.train(clone, steps=4, model=model, optimizer=optimizer)
    assert a["scales"] == b["scales"] and cases.same_weights(a["params"], b["params"])
    p = torch.nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    scaler.scale(torch.ones(()))
    scaler.unscale_(torch.optim.SGD([p], lr=0.1))
    with pytest.raises(AssertionError, match="only be pickled at the beginning"):
        pickle.dumps(scaler)  # torch's rule: not in the middle of an iteration


def test_a_pickle_from_before_the_check_constants_still_steps_a_fused_optimizer():
    # A scaler pickled by an earlier version has no `_check_units` (the
    # scale-1 check's operands, made once per device): it makes them.
    scaler = lt.GradScaler("cpu", **SETTINGS)
    cases.train(scaler, steps=1)
    state = scaler.__getstate__()
    assert state["_check_units"] == {}  # device tensors are not pickled
    del state["_check_units"]
    old = lt.GradScaler.__new__(lt.GradScaler)
    old.__setstate__(state)
    # Fresh models and fused optimizers (a deep copy of torch's fused Adam
    # loses `_step_supports_amp_scaling`, and would not reach the check).
    a = cases.train(pickle.loads(pickle.dumps(scaler)), steps=4, poison=(2,))
    b = cases.train(old, steps=4, poison=(2,))
    assert getattr(b["optimizer"], "_step_supports_amp_scaling", False)
    assert a["scales"] == b["scales"] and a["scales"][2] == a["scales"][1] / 2
    assert cases.same_weights(a["params"], b["params"])


def test_load_state_dict_on_a_disabled_scaler_does_nothing():
    scaler = lt.GradScaler("cpu", enabled=False)
    scaler.load_state_dict({"anything": 1})
    assert scaler.state_dict() == {}


def _good_state():
    scaler = lt.GradScaler("cpu", **SETTINGS, telemetry=True)
    cases.train(scaler, steps=3)
    return scaler.state_dict()


def _replaced(path, value):
    state = copy.deepcopy(_good_state())
    target = state
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return state


@pytest.mark.parametrize(
    "state, error, message",
    [
        (
            torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1).state_dict(),
            ValueError,
            r"`state_dict` must be a GradScaler state dict, with the keys \['scale', .*"
            r"Received: state_dict with keys \['param_groups', 'state'\]",
        ),
        ([1.0], ValueError, "`state_dict` must be a dict returned by GradScaler.state_dict()"),
        ({}, RuntimeError, "`state_dict` is empty: it comes from a GradScaler with enabled=False"),
        *[
            (
                _replaced(["scale"], bad),
                ValueError,
                rf"`state_dict\['scale'\]` holds {shown}, but the loss scale's `scale` must be "
                r"a normal float32 number > 0 \(from 1.17549e-38 to 3.40282e\+38\). "
                r"Nothing was loaded.",
            )
            for bad, shown in [
                (0.0, "0.0"),
                (-4.0, "-4.0"),
                (float("nan"), "nan"),
                (1e-45, "1e-45"),
            ]
        ],
        (
            _replaced(["scale"], "2"),
            ValueError,
            r"`state_dict\['scale'\]` must be a number. Received: state_dict\['scale'\]='2'",
        ),
        (
            _replaced(["_growth_tracker"], -1),
            ValueError,
            r"`state_dict\['_growth_tracker'\]` holds -1, but the loss scale's `counter` must be "
            r"an integer >= 0. Nothing was loaded.",
        ),
        (
            _replaced(["_growth_tracker"], 3.7),
            ValueError,
            r"`state_dict\['_growth_tracker'\]` holds 3.7, but",
        ),
        (
            _replaced(["growth_factor"], 0.5),
            ValueError,
            r"`state_dict\['growth_factor'\]` must be a finite number > 1",
        ),
        (
            _replaced(["growth_interval"], 0),
            ValueError,
            r"`state_dict\['growth_interval'\]` must be an integer >= 1",
        ),
        (
            _replaced(["lossscale"], [1, 2]),
            ValueError,
            r"`state_dict\['lossscale'\]` must be a dict",
        ),
        (
            _replaced(["lossscale", "skips"], 3),
            ValueError,
            r"`state_dict\['lossscale'\]` holds unknown fields \['skips'\]",
        ),
        (
            _replaced(["lossscale", "steps"], 2.5),
            ValueError,
            r"`state_dict\['lossscale'\]\['steps'\]` holds 2.5, but the loss scale's `steps` "
            r"must be an integer >= 0. Nothing was loaded.",
        ),
        (
            _replaced(["lossscale", "consecutive_skips"], -5),
            ValueError,
            r"`state_dict\['lossscale'\]\['consecutive_skips'\]` holds -5, but the loss "
            r"scale's `consecutive_skips` must be an integer >= 0. Nothing was loaded.",
        ),
        (
            _replaced(["lossscale", "scale_history"], [1.0, 2.0]),
            ValueError,
            r"`state_dict\['lossscale'\]\['scale_history'\]` must be a list of 8 numbers",
        ),
    ],
)
def test_a_bad_state_dict_is_an_error_and_loads_nothing(state, error, message):
    scaler = lt.GradScaler("cpu", init_scale=4.0, growth_interval=7, telemetry=True)
    cases.train(scaler, steps=2)
    before = (scaler.state_dict(), scaler.policy, scaler.summary())
    with pytest.raises(error, match=message):
        scaler.load_state_dict(state)
    assert (scaler.state_dict(), scaler.policy, scaler.summary()) == before
