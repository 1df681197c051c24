"""`LossScaleState`: its fields' metadata, the derived field lists and `replaced`."""

import dataclasses

import numpy as np
import pytest

from lossscale.backends import get_ops
from lossscale.mixed_precision import LossScalePolicy, LossScaleState
from lossscale.mixed_precision import state as state_module

# Keras 3's own two variables, in the names Keras gives them.
KERAS = {"scale": "dynamic_scale", "counter": "step_counter"}


def test_field_names_are_the_dataclass_fields_in_declaration_order():
    names = tuple(f.name for f in dataclasses.fields(LossScaleState))
    assert state_module.STATE_FIELD_NAMES == names
    assert names[:2] == ("scale", "counter")
    assert len(set(names)) == len(names) == 22


def test_every_field_is_described():
    groups = {"keras", "streak", "telemetry", "fail_fast", "steps", "diagnostics"}
    for f in dataclasses.fields(LossScaleState):
        meta = f.metadata
        assert meta["group"] in groups, f.name
        assert meta["dtype"] in ("float32", "int32", "bool"), f.name
        assert meta["per"] in ("step", "history", "variable", "vector"), f.name
        # Scalars and vectors default to None, histories and per-variable tuples to ().
        assert f.default == (None if meta["per"] in ("step", "vector") else ()), f.name
        if f.name.startswith("range_"):
            assert meta["group"] == "diagnostics"
    variables = {f.name: f.metadata["variable"] for f in dataclasses.fields(LossScaleState)}
    assert {k: variables[k] for k in KERAS} == KERAS
    assert variables["skipped"] == "skipped_steps"
    # `None` as the initial value means the policy's initial_scale: the scale alone.
    assert [
        f.name for f in dataclasses.fields(LossScaleState) if f.metadata["initial"] is None
    ] == ["scale"]


def test_error_codes_and_history_limits():
    assert (state_module.NO_ERROR, state_module.BELOW_MIN_SCALE, state_module.TOO_MANY_SKIPS) == (
        0,
        1,
        2,
    )
    assert state_module.HISTORY_LENGTH == LossScalePolicy().history_length == 8
    # `overflow_bits` keeps one bit per overflow of the window in an int32.
    assert state_module.MAX_HISTORY_LENGTH == 30 < np.iinfo(np.int32).bits
    LossScalePolicy(history_length=state_module.MAX_HISTORY_LENGTH)


def test_per_variable_fields():
    fields = state_module._FIELDS
    assert [n for n, f in fields.items() if state_module.per_variable(f)] == [
        "nonfinite",
        "overflow_bits",
        "range_zero",
        "range_subnormal",
        "range_near_max",
        "range_max_abs",
    ]
    assert not state_module.per_variable(fields["scale_history"])


def test_a_new_state_tracks_nothing_but_what_it_is_given():
    state = LossScaleState(np.float32(8.0), np.int32(0))
    for name in state_module.STATE_FIELD_NAMES[2:]:
        assert getattr(state, name) == state_module._FIELDS[name].default, name
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.scale = np.float32(4.0)


def test_replaced_changes_the_named_fields_and_keeps_the_others():
    history = (np.float32(1.0), np.float32(2.0))
    state = LossScaleState(np.float32(8.0), np.int32(3), steps=np.int32(5), scale_history=history)
    new = state_module.replaced(state, counter=np.int32(0), skipped=np.int32(1))
    assert isinstance(new, LossScaleState) and new is not state
    assert new.counter == 0 and new.skipped == 1
    assert new.scale is state.scale and new.steps is state.steps
    assert new.scale_history is history
    assert state.counter == 3 and state.skipped is None  # the original is unchanged
    assert new == dataclasses.replace(state, counter=np.int32(0), skipped=np.int32(1))
    assert state_module.replaced(state) == state


def test_replaced_carries_every_field():
    names = state_module.STATE_FIELD_NAMES
    state = LossScaleState(*(np.int32(i) for i in range(len(names))))
    new = state_module.replaced(state, counter=np.int32(-1))
    assert [int(getattr(new, n)) for n in names] == [0, -1, *range(2, len(names))]


def test_replaced_refuses_a_name_that_is_not_a_field():
    state = LossScaleState(np.float32(8.0), np.int32(3))
    with pytest.raises(TypeError) as info:
        state_module.replaced(state, scales=np.float32(4.0), counter=np.int32(0))
    assert str(info.value) == (
        "`replaced` got unknown `LossScaleState` fields: ['scales']. "
        f"Expected names among: {list(state_module.STATE_FIELD_NAMES)}."
    )


def test_variable_specs_list_each_holder_a_policy_needs_in_field_order():
    policy = LossScalePolicy(8.0, 2, telemetry=True, history_length=2, diagnostics_every=3)
    specs = list(state_module.variable_specs(policy, ["dense/kernel", "dense/bias"]))
    by_name = {spec[1]: spec for spec in specs}
    assert specs[0] == ("scale", "dynamic_scale", "float32", None, (), None)
    assert specs[1] == ("counter", "step_counter", "int32", 0, (), None)
    assert by_name["skipped_steps"] == ("skipped", "skipped_steps", "int32", 0, (), None)
    assert by_name["scale_history_1"] == ("scale_history", "scale_history_1", "float32", 0.0, (), 1)
    assert by_name["dense_bias_nonfinite"] == (
        "nonfinite",
        "dense_bias_nonfinite",
        "bool",
        False,
        (),
        1,
    )
    assert by_name["range_zero"] == ("range_zero", "range_zero", "float32", 0.0, (2,), None)
    assert [spec[0] for spec in specs] == sorted(
        (spec[0] for spec in specs), key=state_module.STATE_FIELD_NAMES.index
    )
    plain = list(state_module.variable_specs(LossScalePolicy(8.0, 2), ["w"]))
    assert [spec[1] for spec in plain] == ["dynamic_scale", "step_counter"]
    only = state_module.variable_specs(policy, ["w"], kinds=("history",))
    assert {spec[0] for spec in only} == {
        "scale_history",
        "overflow_steps",
        "overflow_loss",
        "overflow_cause",
    }


class _Box:
    """A holder: what a front end keeps a field in (a variable, a tensor)."""

    def __init__(self, value):
        self.value, self.writes = value, 0

    def assign(self, value):
        self.value, self.writes = value, self.writes + 1


def test_holders_read_flatten_and_write_back_round_trip():
    policy = LossScalePolicy(8.0, 2, telemetry=True, history_length=2)
    specs = state_module.variable_specs(policy, ["w"])
    holders = state_module.holders_of(
        specs, lambda spec: _Box(np.full(spec[4], 8.0 if spec[3] is None else spec[3]))
    )
    assert isinstance(holders["scale_history"], tuple) and len(holders["scale_history"]) == 2
    state = state_module.read(holders, lambda box: box.value)
    assert state.scale == 8.0 and state.scale_history == (0.0, 0.0) and state.error is None
    keys = [key for key, _ in state_module.flatten(state)]
    assert keys == [key for key, _ in state_module.flatten(holders)]
    assert ("scale_history", 1) in keys and ("scale", None) in keys
    # The scale passes into the history: copied before the scale is written.
    ops = get_ops("numpy")
    new = state_module.replaced(
        state,
        scale=np.asarray(16.0),
        scale_history=(state.scale_history[1], state.scale),
    )
    assert set(state_module.changed(state, new)) == {"scale", "scale_history"}
    state_module.write_back(ops, holders, state, new, lambda box: box.value)
    assert float(holders["scale"].value) == 16.0
    assert [float(b.value) for b in holders["scale_history"]] == [0.0, 8.0]
    assert holders["scale_history"][1].value is not state.scale  # a copy, not the old array
    assert holders["counter"].writes == 0  # unchanged: not written
    # A value already held where it belongs (a kernel wrote it in place) is not written again.
    again = state_module.replaced(new, counter=holders["counter"].value + 0)
    held = holders["counter"].value
    state_module.write_back(
        ops, holders, new, state_module.replaced(new, counter=held), lambda b: b.value
    )
    assert holders["counter"].writes == 0 and again.counter is not held
