"""`mixed_precision.step`: the one loss-scale step every front end runs.

`run` is driven here directly, as the front ends drive it, on every
backend: each way of unscaling, the decision and its `found_inf`, the
inner step's gate, the measurement and the state that comes out, against
float64 NumPy and `next_loss_scale` run alone.
"""

import numpy as np
import pytest

from lossscale.backends import get_ops
from lossscale.mixed_precision import diagnostics, step
from lossscale.mixed_precision import state as state_layout
from lossscale.mixed_precision.loss_scale import (
    BELOW_MIN_SCALE,
    LossScalePolicy,
    LossScaleState,
    next_loss_scale,
)

# Sizes on both sides of the backends' packing and chunking thresholds.
SIZES = (1, 70, 4097, 131_072)


def _state(ops, policy, count, like):
    def make(spec):
        _, _, dtype, initial, shape, _ = spec
        value = policy.initial_scale if initial is None else initial
        return ops.full(shape, value, dtype, like=like)

    specs = state_layout.variable_specs(policy, [""] * count)
    return LossScaleState(**state_layout.holders_of(specs, make))


def _grads(backend, rng, scale, bad=None):
    """Scaled gradients of `SIZES` (float64 truth kept), one bad value where asked."""
    truth = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    scaled = [t * np.float32(scale) for t in truth]
    if bad is not None:
        tensor, where, value = bad
        flat = scaled[tensor]
        flat[{"first": 0, "last": flat.size - 1, "random": rng.integers(flat.size)}[where]] = value
    return truth, [backend.array(g) for g in scaled]


def _run(backend, policy, grads, unscale="copy", divided=None, state=None, **kwargs):
    ops = get_ops(backend.name)
    like = next(g for g in grads if g is not None)
    state = state if state is not None else _state(ops, policy, len(grads), like)
    seen = []

    def inner(decision):
        seen.append(decision)
        return "inner's result"

    gradients = step.Gradients(
        grads,
        divided=[g is not None for g in grads] if divided is None else divided,
        index_of=lambda i: i,
        variable_count=len(grads),
        unscale=unscale,
        divide_fn=lambda gs, scale: ops.unscale(gs, scale),
        unscaled_dtypes=["float32"] * len(grads),
    )
    new, result = step.run(ops, policy, state, gradients, inner, **kwargs)
    assert result == "inner's result" and len(seen) == 1
    return state, new, seen[0]


@pytest.mark.parametrize("unscale", ["copy", "in_place", "after_check"])
def test_finite_gradients_are_unscaled_and_kept(backend, rng, unscale):
    policy = LossScalePolicy(initial_scale=2.0**10, dynamic_growth_steps=3)
    truth, grads = _grads(backend, rng, 2.0**10)
    state, new, decision = _run(backend, policy, grads, unscale=unscale)
    assert bool(backend.numpy(decision.keep)) and bool(backend.numpy(decision.finite))
    assert decision.grad_scale is None
    for got, want in zip(decision.grads, truth):
        np.testing.assert_array_equal(backend.numpy(got), want)  # a power of two: exact
    assert float(backend.numpy(new.scale)) == 2.0**10 and int(backend.numpy(new.counter)) == 1


@pytest.mark.parametrize("unscale", ["copy", "in_place", "in_kernel", "after_check"])
@pytest.mark.parametrize("where", ["first", "last", "random"])
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_one_bad_value_anywhere_is_not_kept_and_backs_off(backend, rng, unscale, where, value):
    policy = LossScalePolicy(initial_scale=2.0**10)
    tensor = int(rng.integers(len(SIZES)))
    _, grads = _grads(backend, rng, 2.0**10, bad=(tensor, where, value))
    _, new, decision = _run(backend, policy, grads, unscale=unscale)
    assert not bool(backend.numpy(decision.keep))
    assert float(backend.numpy(new.scale)) == 2.0**9 and int(backend.numpy(new.counter)) == 0


@pytest.mark.parametrize("unscale", ["copy", "in_place", "in_kernel", "after_check"])
def test_a_gradient_that_overflows_only_once_unscaled_is_not_kept(backend, rng, unscale):
    # Finite scaled values, a scale below 1: dividing takes one past float32's range.
    policy = LossScalePolicy(initial_scale=2.0**-10)
    grads = [backend.array(np.full(70, 3e37, np.float32)), backend.array(np.ones(5, np.float32))]
    _, _, decision = _run(backend, policy, grads, unscale=unscale)
    assert not bool(backend.numpy(decision.keep))


def test_in_kernel_leaves_the_gradients_scaled_for_the_kernel(backend, rng):
    policy = LossScalePolicy(initial_scale=2.0**10)
    _, grads = _grads(backend, rng, 2.0**10)
    state, _, decision = _run(backend, policy, grads, unscale="in_kernel")
    assert decision.grad_scale is state.scale and decision.found_inf is None
    assert all(a is b for a, b in zip(decision.grads, grads))


def test_in_place_divides_the_callers_buffers_where_the_backend_writes_in_place(backend, rng):
    policy = LossScalePolicy(initial_scale=2.0**10)
    truth, grads = _grads(backend, rng, 2.0**10)
    kept = [backend.numpy(g).copy() for g in grads]
    _, _, decision = _run(backend, policy, grads, unscale="copy")
    for g, k in zip(grads, kept):  # a copy: the caller's buffers as they were
        np.testing.assert_array_equal(backend.numpy(g), k)
    _, _, decision = _run(backend, policy, grads, unscale="in_place")
    for got, want in zip(decision.grads, truth):
        np.testing.assert_array_equal(backend.numpy(got), want)
    if backend.name == "torch":  # divided where they are (NumPy leaves them: its kernels divide)
        assert all(a is b for a, b in zip(decision.grads, grads))


def test_a_gradient_not_divided_is_checked_as_it_is(backend, rng):
    # An overwrite-with-gradient variable's gradient: its variable takes it as is.
    policy = LossScalePolicy(initial_scale=2.0**10)
    _, grads = _grads(backend, rng, 2.0**10)
    divided = [True, False, True, True]
    for unscale in ("copy", "in_place"):
        _, _, decision = _run(backend, policy, grads, unscale=unscale, divided=divided)
        assert decision.grads[1] is grads[1] and bool(backend.numpy(decision.keep))
    grads[1] = backend.array(np.array([np.nan] * 70, np.float32))
    _, _, decision = _run(backend, policy, grads, divided=divided)
    assert not bool(backend.numpy(decision.keep))


def test_none_gradients_are_passed_through(backend, rng):
    policy = LossScalePolicy(initial_scale=4.0, telemetry=True)
    grads = [backend.array(np.ones(3, np.float32)), None, backend.array(np.ones(2, np.float32))]
    _, new, decision = _run(backend, policy, grads)
    assert decision.grads[1] is None and bool(backend.numpy(decision.keep))
    assert len(new.nonfinite) == 3


def test_found_inf_is_given_only_where_the_local_check_is_the_decision():
    import torch

    ops = get_ops("torch")
    grads = [torch.ones(70) * 4, torch.ones(3) * 4]
    for policy, expected in (
        (LossScalePolicy(initial_scale=4.0), True),  # one participant, no limits
        (LossScalePolicy(initial_scale=4.0, max_consecutive_skips=3), False),  # gated by error
    ):
        state = _state(ops, policy, 2, grads[0])
        gradients = step.Gradients(list(grads), [True, True], lambda i: i, 2, unscale="copy")
        found = step.check(ops, policy, state.scale, gradients)
        decision = step.decide(ops, policy, state, found)
        assert (decision.found_inf is not None) is expected
        if expected:
            assert float(decision.found_inf) == 0.0


def test_a_recorded_error_keeps_finite_steps_from_being_applied(backend, rng):
    policy = LossScalePolicy(initial_scale=4.0, min_scale=1.0)
    ops = get_ops(backend.name)
    _, grads = _grads(backend, rng, 4.0)
    state = _state(ops, policy, len(grads), grads[0])
    state = state_layout.LossScaleState(
        **{
            **{n: getattr(state, n) for n in state_layout.STATE_FIELD_NAMES},
            "error": ops.full((), BELOW_MIN_SCALE, "int32", like=grads[0]),
        }
    )
    _, new, decision = _run(backend, policy, grads, state=state)
    assert bool(backend.numpy(decision.finite)) and not bool(backend.numpy(decision.keep))
    assert float(backend.numpy(new.scale)) == 4.0  # frozen


def test_the_new_state_is_next_loss_scale_of_the_agreed_flag(backend, rng):
    # Telemetry: per-variable flags placed by each gradient's variable.
    policy = LossScalePolicy(initial_scale=2.0**10, telemetry=True, hysteresis=2)
    ops = get_ops(backend.name)
    _, grads = _grads(backend, rng, 2.0**10, bad=(2, "random", np.nan))
    state, new, decision = _run(backend, policy, grads)
    flags = [ops.asarray(np.array(f), like=grads[0]) for f in (True, True, False, True)]
    want = next_loss_scale(ops, state, decision.finite, policy, variable_finite=flags)
    for (key, got), (_, expected) in zip(state_layout.flatten(new), state_layout.flatten(want)):
        np.testing.assert_array_equal(backend.numpy(got), backend.numpy(expected), err_msg=key)
    assert [bool(backend.numpy(x)) for x in new.nonfinite] == [False, False, True, False]


@pytest.mark.parametrize("due", [True, False, "device"])
def test_the_float16_range_is_measured_where_due(backend, rng, due):
    policy = LossScalePolicy(initial_scale=2.0**10, diagnostics_every=2)
    ops = get_ops(backend.name)
    _, grads = _grads(backend, rng, 2.0**10)
    if due == "device":
        due = ops.asarray(np.array(True), like=grads[0])
    _, new, _ = _run(backend, policy, grads, due=due)
    measured = due is True or due is not False
    for i, g in enumerate(grads):
        want = diagnostics.measure(ops, g, policy.growth_factor)
        got = [backend.numpy(getattr(new, f))[i] for f in diagnostics.FIELDS]
        if measured:
            np.testing.assert_array_equal(got, [backend.numpy(w) for w in want])
        else:
            assert got == [0.0, 0.0, 0.0, 0.0]
    assert int(backend.numpy(new.range_step)) == (0 if measured else -1)


def test_an_unknown_unscaling_is_refused_naming_the_accepted_ones():
    message = (
        r"^`unscale` must be one of \('in_place', 'copy', 'in_kernel', 'after_check'\). "
        r"Received: unscale='later'$"
    )
    with pytest.raises(ValueError, match=message):
        step.Gradients([], [], lambda i: i, 0, unscale="later")
