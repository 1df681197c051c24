"""`LossScaleState`: its fields' metadata, the derived field lists and `replaced`."""

import dataclasses

import numpy as np
import pytest

from lossscale.mixed_precision import LossScalePolicy, LossScaleState
from lossscale.mixed_precision import state as state_module

# Keras 3's own two variables, in the names Keras gives them.
KERAS = {"scale": "dynamic_scale", "counter": "step_counter"}


def test_field_names_are_the_dataclass_fields_in_declaration_order():
    names = tuple(f.name for f in dataclasses.fields(LossScaleState))
    assert state_module.STATE_FIELD_NAMES == names
    assert names[:2] == ("scale", "counter")
    assert len(set(names)) == len(names) == 19


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
