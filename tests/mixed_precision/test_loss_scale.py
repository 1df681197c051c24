"""The pure loss-scale state machine against the pure-Python reference."""

import dataclasses  # noqa: E402
import math  # noqa: E402

import numpy as np
import pytest
from hypothesis import (
    assume,  # noqa: E402
    given,
    settings,
)
from hypothesis import strategies as st

from lossscale.backends import get_ops
from lossscale.mixed_precision import LossScalePolicy, LossScaleState, loss_scale, next_loss_scale
from lossscale.mixed_precision import loss_scale as ls_module  # noqa: E402
from lossscale.mixed_precision.loss_scale import MIN_SCALE
from tests.conftest import BACKENDS, Backend  # noqa: E402
from tests.reference import F32_MAX, F32_TINY, ReferenceLossScale


def run(backend, policy, pattern):
    ops = get_ops(backend.name)
    state = LossScaleState(
        backend.array(np.float32(policy.initial_scale)), backend.array(np.int32(0))
    )
    ref = ReferenceLossScale(policy.initial_scale, policy.dynamic_growth_steps)
    for finite in pattern:
        state = next_loss_scale(ops, state, backend.array(np.bool_(finite)), policy)
        ref.step(finite)
        assert float(backend.numpy(state.scale)) == ref.scale
        assert int(backend.numpy(state.counter)) == ref.counter
        assert backend.numpy(state.scale).dtype == np.float32
    return ref


def test_known_trajectory(backend):
    ref = run(backend, LossScalePolicy(8.0, 2), [True, True, False, True, True, True, False, False])
    assert ref.scale == 4.0 and ref.counter == 0


def test_guards_at_both_ends(backend):
    ref = run(backend, LossScalePolicy(2.0**127, 1), [True] * 3)
    assert ref.scale == 2.0**127
    ref = run(backend, LossScalePolicy(F32_TINY * 2, 5), [False] * 4)
    assert ref.scale == F32_TINY


@settings(max_examples=60, deadline=None)
@given(
    initial=st.sampled_from([1.0, 2.0**15, 2.0**126, 3.0 * F32_TINY]),
    growth=st.integers(1, 4),
    pattern=st.lists(st.booleans(), max_size=30),
)
def test_random_sequences_numpy(initial, growth, pattern):
    from tests.conftest import Backend

    run(Backend("numpy"), LossScalePolicy(initial, growth), pattern)


F16_MAX = 65504.0


f32 = np.float32


class Model:
    """Pure-Python model of `next_loss_scale` with every option (float32 arithmetic)."""

    def __init__(self, policy, n_vars):
        p = self.p = policy
        self.scale, self.counter, self.streak = float(f32(p.initial_scale)), 0, 0
        self.steps, self.skipped, self.last, self.error, self.error_step = 0, 0, -1, 0, -1
        self.history = [0.0] * p.history_length
        self.nonfinite = [False] * n_vars
        self.loss_finite = -1
        self.overflow_steps = [-1] * p.history_length
        self.overflow_loss = [-1] * p.history_length
        self.overflow_bits = [0] * n_vars
        self.overflow_cause = [-1] * p.history_length
        self.streak_scale, self.persistent_step = 0.0, -1
        self.range_step = -1

    def step(self, finite, peak, variable_finite, loss=-1, near=0.0):
        """One step; `loss` the step's `loss_finite`, `near` its measured near-max share."""
        p = self.p
        if self.error:
            return
        self.loss_finite = loss
        used = self.scale
        measured = p.diagnoses and self.steps % p.diagnostics_every == 0
        statistics = p.growth_policy == "statistics"
        if statistics:
            early = finite and measured and near > 0
            room = f32(f32(peak) * f32(p.growth_factor)) < f32(F16_MAX / ls_module.HEADROOM_MARGIN)
            grow = finite and measured and room and not early
        else:
            early, grow = False, finite and self.counter == p.dynamic_growth_steps - 1
        if measured:
            self.range_step = self.steps
        if finite:
            self.streak, self.streak_scale = 0, 0.0
            if early:
                backed = float(f32(f32(used) * f32(p.backoff_factor)))
                if p.min_scale is None:
                    self.scale = max(backed, F32_TINY)
                elif backed >= float(f32(p.min_scale)):
                    self.scale = backed
                self.counter = 0
            elif grow:
                with np.errstate(over="ignore"):
                    grown = float(f32(f32(used) * f32(p.growth_factor)))
                if p.max_scale is not None:
                    grown = min(grown, float(f32(p.max_scale)))
                elif not math.isfinite(grown):
                    grown = used
                if p.growth_policy == "headroom" and not (
                    f32(f32(peak) * f32(p.growth_factor)) < f32(F16_MAX / ls_module.HEADROOM_MARGIN)
                ):
                    grown = used
                self.scale, self.counter = grown, 0
            else:
                self.counter += 1
        else:
            bad = {i for i, ok in enumerate(variable_finite) if ok is False}
            before = {i for i, was in enumerate(self.nonfinite) if was}
            # Persistent: the streak goes on, the scale fell by 2**8 since it
            # began (or is at most 1), the same variables still bad (some).
            persistent = (
                self.streak > 0
                and (self.streak_scale >= float(f32(f32(used) * f32(2.0**8))) or used <= 1)
                and bad
                and bad <= before
            )
            if self.streak == 0:
                self.streak_scale = used
            if persistent and self.persistent_step < 0:
                self.persistent_step = self.steps
            cause = 2 if persistent else (1 if self.loss_finite == 0 else 0)
            self.overflow_cause = self.overflow_cause[1:] + [cause]
            self.counter, self.streak = 0, self.streak + 1
            if self.streak >= p.hysteresis:
                backed = float(f32(f32(used) * f32(p.backoff_factor)))
                if p.min_scale is not None and backed < float(f32(p.min_scale)):
                    self.error = ls_module.BELOW_MIN_SCALE
                else:
                    self.scale = max(backed, F32_TINY)
            if (
                not self.error
                and p.max_consecutive_skips is not None
                and self.streak > p.max_consecutive_skips
            ):
                self.error = ls_module.TOO_MANY_SKIPS
            self.skipped, self.last = self.skipped + 1, self.steps
            self.nonfinite = [ok is False for ok in variable_finite]
            self.overflow_steps = self.overflow_steps[1:] + [self.steps]
            self.overflow_loss = self.overflow_loss[1:] + [self.loss_finite]
            wrap = 2**p.history_length
            self.overflow_bits = [
                (b * 2 + (ok is False)) % wrap for b, ok in zip(self.overflow_bits, variable_finite)
            ]
        if self.error:
            self.error_step = self.steps
        self.history = self.history[1:] + [used]
        self.loss_finite = -1
        self.steps += 1

    def expected(self):
        """The model as `{state field: value}` for the fields the policy tracks."""
        values = dict(
            scale=self.scale,
            counter=self.counter,
            consecutive_skips=self.streak,
            steps=self.steps,
            skipped=self.skipped,
            last_overflow_step=self.last,
            scale_history=self.history,
            nonfinite=self.nonfinite,
            error=self.error,
            error_step=self.error_step,
            loss_finite=self.loss_finite,
            overflow_steps=self.overflow_steps,
            overflow_loss=self.overflow_loss,
            overflow_bits=self.overflow_bits,
            overflow_cause=self.overflow_cause,
            streak_scale=self.streak_scale,
            persistent_step=self.persistent_step,
            range_step=self.range_step,
        )
        return {
            f.name: values[f.name]
            for f in ls_module.state_fields(self.p)
            if not f.name.startswith("range_") or f.name == "range_step"
        }


def initial_state(backend, policy, n_vars):
    """A full initial state on `backend`, as the optimizer builds it."""
    values = {}
    for f in ls_module.state_fields(policy):
        initial = f.metadata["initial"]
        initial = policy.initial_scale if initial is None else initial
        dtype = f.metadata["dtype"]
        if f.metadata["per"] == "vector":
            values[f.name] = backend.array(np.full(n_vars, initial, dtype))
            continue
        count = {"step": None, "history": policy.history_length, "variable": n_vars}[
            f.metadata["per"]
        ]
        one = lambda initial=initial, dtype=dtype: backend.array(np.asarray(initial, dtype))  # noqa: E731
        values[f.name] = one() if count is None else tuple(one() for _ in range(count))
    return LossScaleState(**values)


def read_state(backend, state, policy):
    out = {}
    for f in ls_module.state_fields(policy):
        value = getattr(state, f.name)
        if isinstance(value, tuple):
            out[f.name] = [backend.numpy(x).item() for x in value]
        elif f.metadata["per"] == "vector":
            out[f.name] = backend.numpy(value).tolist()
        else:
            out[f.name] = backend.numpy(value).item()
    return out


@st.composite
def policies(draw):
    options = dict(
        initial_scale=draw(st.sampled_from([1.0, 8.0, 2.0**15, 2.0**126, 3.0 * F32_TINY])),
        dynamic_growth_steps=draw(st.integers(1, 4)),
        growth_factor=draw(st.sampled_from([2.0, 1.5, 4.0, 3.0])),
        backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.75, 0.375])),
        hysteresis=draw(st.integers(1, 3)),
        min_scale=draw(st.sampled_from([None, None, 1.0, 0.125, F32_TINY * 2])),
        max_scale=draw(st.sampled_from([None, None, 64.0, 2.0**20])),
        max_consecutive_skips=draw(st.sampled_from([None, None, 0, 2, 4])),
        growth_policy=draw(st.sampled_from(["fixed", "headroom", "statistics"])),
        telemetry=draw(st.booleans()),
        diagnostics_every=draw(st.sampled_from([None, 1, 2, 3])),
        history_length=draw(st.sampled_from([8, 1, 3, 30])),
    )
    if options["growth_policy"] == "statistics" and options["diagnostics_every"] is None:
        options["diagnostics_every"] = 2
    low, high = options["min_scale"] or 0.0, options["max_scale"] or F32_MAX
    assume(low <= options["initial_scale"] <= high and low < high)
    return LossScalePolicy(**options)


# Each step: per-variable gradient status (True finite, False non-finite,
# None no gradient), the largest scaled gradient magnitude, the loss's flag
# (1 finite, 0 not, -1 not recorded) and the measured near-max share.
STEPS = st.lists(
    st.tuples(
        st.lists(st.sampled_from([True, True, True, False, None]), min_size=3, max_size=3),
        st.sampled_from([0.5, 100.0, 4000.0, 4095.0, 4096.0, 30000.0]),
        st.sampled_from([1, 1, 0, -1]),
        st.sampled_from([0.0, 0.0, 1e-6, 0.25]),
    ),
    max_size=14,
)


def check_against_model(backend, policy, steps):
    ops = get_ops(backend.name)
    state = initial_state(backend, policy, 3)
    model = Model(policy, 3)
    for step, (flags, peak, loss, near) in enumerate(steps):
        finite = all(ok is not False for ok in flags)
        measured = None
        if policy.diagnoses:
            # What a measuring caller writes before the step: the range
            # fields, here the near-max share and the peak on every variable.
            measured = backend.array(np.bool_(model.steps % policy.diagnostics_every == 0))
            if not model.error:
                near_values = tuple(backend.array(f32(near)) for _ in range(3))
                peaks = tuple(backend.array(f32(peak)) for _ in range(3))
                state = dataclasses.replace(state, range_near_max=near_values, range_max_abs=peaks)
        if policy.records_details and not model.error:
            state = dataclasses.replace(state, loss_finite=backend.array(np.int32(loss)))
        if policy.records_details:
            variable_finite = tuple(
                None if ok is None else backend.array(np.bool_(ok)) for ok in flags
            )
        else:
            variable_finite = ()
            state = dataclasses.replace(state, nonfinite=())
        state = next_loss_scale(
            ops,
            state,
            backend.array(np.bool_(finite)),
            policy,
            peak=backend.array(f32(peak)),
            variable_finite=variable_finite,
            measured=measured,
        )
        model.step(finite, peak, flags, loss if policy.records_details else -1, near)
        got = read_state(backend, state, policy)
        expected = model.expected()
        if not policy.records_details:
            expected.pop("nonfinite", None)
            got.pop("nonfinite", None)
        for name in ("range_zero", "range_subnormal", "range_near_max", "range_max_abs"):
            got.pop(name, None)  # the caller's to write
        assert got == expected, step
        assert backend.numpy(state.scale).dtype == np.float32


# Driving the pure function directly is cheap: most of the examples per run
# are here, as many on each backend; tests/optimizers/test_loss_scale_optimizer.py runs
# fewer through the whole optimizer, stateful and stateless.
@settings(max_examples=60, deadline=None)
@given(policy=policies(), steps=STEPS)
@pytest.mark.parametrize("name", BACKENDS)
def test_state_machine_matches_model(name, policy, steps):
    check_against_model(Backend(name), policy, steps)


def test_hysteresis_backs_off_at_the_nth_overflow_in_a_row(backend):
    policy = LossScalePolicy(64.0, 10, hysteresis=3)
    ops = get_ops(backend.name)
    state = initial_state(backend, policy, 0)
    scales = []
    for finite in [False, False, False, False, True, False, False, False]:
        state = next_loss_scale(ops, state, backend.array(np.bool_(finite)), policy)
        scales.append(backend.numpy(state.scale).item())
    # Two tolerated, then every further overflow; a finite step resets the count.
    assert scales == [64.0, 64.0, 32.0, 16.0, 16.0, 16.0, 16.0, 8.0]


def test_factors_and_max_scale(backend):
    policy = LossScalePolicy(4.0, 1, growth_factor=4.0, backoff_factor=0.25, max_scale=128.0)
    ops = get_ops(backend.name)
    state = initial_state(backend, policy, 0)
    scales = []
    for finite in [True, True, True, False, True]:
        state = next_loss_scale(ops, state, backend.array(np.bool_(finite)), policy)
        scales.append(backend.numpy(state.scale).item())
    assert scales == [16.0, 64.0, 128.0, 32.0, 128.0]


def test_headroom_blocks_growth_near_float16_max(backend):
    policy = LossScalePolicy(8.0, 1, growth_policy="headroom")
    ops = get_ops(backend.name)
    limit = F16_MAX / ls_module.HEADROOM_MARGIN
    state = initial_state(backend, policy, 0)
    scales = []
    for peak in [limit / 2 - 1, limit / 2, 10.0]:
        state = next_loss_scale(
            ops, state, backend.array(np.bool_(True)), policy, peak=backend.array(f32(peak))
        )
        scales.append(backend.numpy(state.scale).item())
        assert backend.numpy(state.counter).item() == 0  # a blocked growth resets it too
    assert scales == [16.0, 16.0, 32.0]


def test_min_scale_error_freezes_the_state(backend):
    policy = LossScalePolicy(2.0, 5, min_scale=1.0)
    ops = get_ops(backend.name)
    state = initial_state(backend, policy, 2)
    overflow = backend.array(np.bool_(False))
    flags = (backend.array(np.bool_(True)), backend.array(np.bool_(False)))
    for _ in range(2):
        state = next_loss_scale(ops, state, overflow, policy, variable_finite=flags)
    assert read_state(backend, state, policy)["error"] == ls_module.BELOW_MIN_SCALE
    frozen = read_state(backend, state, policy)
    assert frozen["scale"] == 1.0 and frozen["error_step"] == 1 and frozen["steps"] == 2
    assert frozen["nonfinite"] == [False, True]
    assert not backend.numpy(
        ls_module.may_apply(ops, state, backend.array(np.bool_(True)), policy)
    ).item()
    for finite in [True, False]:
        state = next_loss_scale(
            ops, state, backend.array(np.bool_(finite)), policy, variable_finite=flags
        )
        assert read_state(backend, state, policy) == frozen


def test_two_field_state_is_completed(backend):
    policy = LossScalePolicy(8.0, 2, telemetry=True, max_consecutive_skips=1)
    state = LossScaleState(backend.array(f32(8.0)), backend.array(np.int32(0)))
    state = next_loss_scale(get_ops(backend.name), state, backend.array(np.bool_(False)), policy)
    got = read_state(backend, state, policy)
    assert got["scale"] == 4.0 and got["steps"] == 1 and got["skipped"] == 1
    assert got["last_overflow_step"] == 0 and got["error"] == 0 and got["error_step"] == -1
    assert got["scale_history"] == [0.0] * 7 + [8.0]


def test_next_loss_scale_argument_errors():
    ops = get_ops("numpy")
    state = LossScaleState(np.float32(8.0), np.int64(0))
    with pytest.raises(
        ValueError, match='`peak` is required with growth_policy="headroom". Received: peak=None'
    ):
        next_loss_scale(ops, state, np.bool_(True), LossScalePolicy(growth_policy="headroom"))
    with pytest.raises(
        ValueError,
        match=r"`variable_finite` must hold one entry per entry of "
        r"`state.nonfinite` \(0\). Received: 2 entries",
    ):
        next_loss_scale(ops, state, np.bool_(True), LossScalePolicy(), variable_finite=(1, 2))


def test_jit_traces_every_option():
    import jax
    import jax.numpy as jnp

    policy = LossScalePolicy(
        8.0,
        2,
        hysteresis=2,
        min_scale=0.5,
        max_scale=64.0,
        max_consecutive_skips=6,
        growth_policy="headroom",
    )
    backend = Backend("jax")
    ops = get_ops("jax")
    model = Model(policy, 2)
    traces = []

    def step(fields, finite, peak, flags):
        traces.append(1)
        return dataclasses.asdict(
            next_loss_scale(
                ops, LossScaleState(**fields), finite, policy, peak=peak, variable_finite=flags
            )
        )

    jitted = jax.jit(step)
    state = initial_state(backend, policy, 2)
    for finite, peak in [
        (True, 1.0),
        (True, 1.0),
        (False, 1.0),
        (True, 5000.0),
        (True, 5000.0),
        (False, 1.0),
        (False, 1.0),
        (False, 1.0),
        (False, 1.0),
        (False, 1.0),
        (False, 1.0),
        (False, 1.0),
        (True, 1.0),
    ]:
        flags = (jnp.asarray(True), jnp.asarray(finite))
        state = LossScaleState(
            **jitted(dataclasses.asdict(state), jnp.asarray(finite), jnp.asarray(f32(peak)), flags)
        )
        model.step(finite, peak, [True, finite])
        assert read_state(backend, state, policy) == model.expected()
    assert model.error == ls_module.BELOW_MIN_SCALE
    assert len(traces) == 1


def test_one_update_lowers_the_bound_by_a_backoff_and_float32_rounding():
    policy = LossScalePolicy(2.0**16)
    assert loss_scale.scale_lower_bound(2.0**16, policy) == 2.0**15 * loss_scale.BOUND_ROUNDING


def test_max_scale_caps_the_bound():
    policy = LossScalePolicy(2.0**10, max_scale=2.0**10)
    assert loss_scale.scale_lower_bound(2.0**16, policy) == 2.0**10


def test_a_plain_policy_at_its_floor_stays_there_and_another_goes_under():
    plain = LossScalePolicy(2.0**16)
    assert plain.is_plain
    assert loss_scale.scale_lower_bound(MIN_SCALE, plain) == MIN_SCALE
    assert loss_scale.scale_lower_bound(MIN_SCALE / 4, plain) < MIN_SCALE / 4
    capped = LossScalePolicy(2.0**16, max_scale=2.0**20)
    assert not capped.is_plain
    assert loss_scale.scale_lower_bound(MIN_SCALE, capped) < MIN_SCALE
