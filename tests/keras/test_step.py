"""keras/step.py: the loss-scale part of one Keras step, as pure functions of arrays.

Run here with the NumPy and torch backend modules on native arrays:
`unscale` divides exactly the gradients it should (against float64 NumPy),
`decide` skips on an inf or NaN at the first, last or a random element and
gives `next_loss_scale`'s state, `measured` writes the float16 range only
when due, and the state's variables round-trip through `state_of` and
`flat_items`; `extra_fields` names what Keras's wrapper lacks.
"""

import os

os.environ["KERAS_BACKEND"] = "torch"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from lossscale.backends import get_ops  # noqa: E402
from lossscale.keras import step  # noqa: E402
from lossscale.mixed_precision import LossScalePolicy, LossScaleState, diagnostics  # noqa: E402
from lossscale.mixed_precision.loss_scale import next_loss_scale  # noqa: E402
from tests.conftest import Backend  # noqa: E402

SHAPES = [(64, 33), (7,), (4097,)]


def _grads(backend, scale, bad=None, seed=0):
    rng = np.random.default_rng(seed)
    values = [(rng.standard_normal(s) * scale).astype(np.float32) for s in SHAPES]
    if bad is not None:
        flat = values[2].reshape(-1)
        index = {"first": 0, "last": flat.size - 1, "random": int(rng.integers(flat.size))}[bad]
        flat[index] = np.nan if bad == "random" else np.inf
    return values, [backend.array(v) for v in values]


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_unscale_divides_all_but_missing_and_overwrite_gradients(name):
    backend = Backend(name)
    ops = get_ops(name)
    values, grads = _grads(backend, 2.0**10)
    grads = [grads[0], None, grads[2]]
    unscaled, divided = step.unscale(
        ops, grads, [False, False, True], backend.array(np.float32(2.0**10))
    )
    assert divided == [0] and unscaled[1] is None and unscaled[2] is grads[2]
    np.testing.assert_array_equal(
        backend.numpy(unscaled[0]), (values[0].astype(np.float64) / 2.0**10).astype(np.float32)
    )


def _state(backend, policy):
    return LossScaleState(
        backend.array(np.float32(policy.initial_scale)), backend.array(np.int32(0))
    )


@pytest.mark.parametrize("name", ["numpy", "torch"])
@pytest.mark.parametrize("bad", [None, "first", "last", "random"])
def test_decide_skips_an_overflow_and_takes_next_loss_scale_s_state(name, bad):
    backend = Backend(name)
    ops = get_ops(name)
    policy = LossScalePolicy(2.0**10, 1)
    state = _state(backend, policy)
    _, grads = _grads(backend, 2.0**10, bad)
    scale = backend.array(np.float32(2.0**10))
    unscaled, divided = step.unscale(ops, grads, [False] * 3, scale)
    agreed = []
    agree = (lambda flag: agreed.append("flag") or flag, lambda peak: agreed.append("peak") or peak)
    take, new = step.decide(
        ops, state, grads, unscaled, divided, scale, policy, [0, 1, 2], 3, agree
    )
    assert bool(backend.numpy(take)) is (bad is None) and agreed == ["flag"]
    expected = next_loss_scale(ops, state, backend.array(np.bool_(bad is None)), policy)
    assert float(backend.numpy(new.scale)) == float(backend.numpy(expected.scale))
    assert float(backend.numpy(new.scale)) == (2.0**9 if bad else 2.0**11)
    assert int(backend.numpy(new.counter)) == 0


def test_inspect_with_telemetry_flags_each_variable_and_catches_an_unscaling_overflow():
    backend = Backend("numpy")
    ops = get_ops("numpy")
    policy = LossScalePolicy(0.25, 2, telemetry=True)
    grads = [np.full(3, 3e38, np.float32), np.ones(2, np.float32)]
    scale = np.float32(0.25)  # 3e38 / 0.25 overflows float32
    with ops.quiet():  # as `apply` divides: the overflow is the point
        unscaled, divided = step.unscale(ops, grads, [False, False], scale)
    finite, peak, variable_finite = step.inspect(
        ops, grads, unscaled, divided, scale, policy, [1, 0], 2
    )
    assert not bool(finite) and peak is None
    # Entry i is the variable at build index i: the gradients came in reverse.
    assert [bool(backend.numpy(f)) for f in variable_finite] == [True, False]


@pytest.mark.parametrize("due", [False, True])
def test_measured_writes_the_float16_range_only_when_due(due):
    ops = get_ops("numpy")
    policy = LossScalePolicy(2.0**10, 2, diagnostics_every=3)
    fields = {f: np.zeros(3, np.float32) for f in diagnostics.FIELDS}
    state = LossScaleState(np.float32(2.0**10), np.int32(0), **fields)
    grads = [np.full((2, 2), 70000.0, np.float32), None, np.zeros((0,), np.float32)]
    new = step.measured(ops, state, grads, policy, [2, 0, 1], due)
    if not due:
        assert new is state
        return
    # The one gradient with values is variable 2's: every element beyond
    # float16's range, none zero; the others keep their entries.
    np.testing.assert_array_equal(new.range_near_max, [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(new.range_zero, [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(new.range_max_abs, [0.0, 0.0, 70000.0])


def test_state_of_and_flat_items_round_trip_a_telemetry_state():
    policy = LossScalePolicy(8.0, 2, telemetry=True, history_length=2)
    variables = {
        "scale": ["s"],
        "counter": ["c"],
        "steps": ["n"],
        "scale_history": (["h0"], ["h1"]),
    }
    state = step.state_of(variables, lambda box: box[0])
    assert state.scale == "s" and state.scale_history == ("h0", "h1") and state.skipped is None
    items = list(step.flat_items(state))
    assert items == [
        (("scale", None), "s"),
        (("counter", None), "c"),
        (("steps", None), "n"),
        (("scale_history", 0), "h0"),
        (("scale_history", 1), "h1"),
    ]
    assert [key for key, _ in step.flat_items(variables)] == [key for key, _ in items]
    names = [f[0] for f in step.extra_fields(policy)]
    assert "scale" not in names and "counter" not in names
    fields = {f[0]: f[1:] for f in step.extra_fields(policy)}
    assert fields["skipped"] == ("skipped_steps", "int32", 0, "step")
    assert fields["scale_history"] == ("scale_history", "float32", 0.0, "history")
    assert fields["nonfinite"][3] == "variable"
    assert step.extra_fields(LossScalePolicy(8.0, 2)) == []
