"""The pure loss-scale state machine against the pure-Python reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale.backends import get_ops
from lossscale.mixed_precision import LossScalePolicy, LossScaleState, next_loss_scale
from reference import F32_MAX, F32_TINY, ReferenceLossScale


def run(backend, policy, pattern):
    ops = get_ops(backend.name)
    state = LossScaleState(backend.array(np.float32(policy.initial_scale)),
                           backend.array(np.int32(0)))
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
    ref = run(backend, LossScalePolicy(2.0 ** 127, 1), [True] * 3)
    assert ref.scale == 2.0 ** 127
    ref = run(backend, LossScalePolicy(F32_TINY * 2, 5), [False] * 4)
    assert ref.scale == F32_TINY


@settings(max_examples=60, deadline=None)
@given(initial=st.sampled_from([1.0, 2.0 ** 15, 2.0 ** 126, 3.0 * F32_TINY]),
       growth=st.integers(1, 4), pattern=st.lists(st.booleans(), max_size=30))
def test_random_sequences_numpy(initial, growth, pattern):
    from conftest import Backend

    run(Backend("numpy"), LossScalePolicy(initial, growth), pattern)


@pytest.mark.parametrize("kwargs, message", [
    ({"initial_scale": 0}, "`initial_scale` must be a finite number > 0"),
    ({"initial_scale": F32_MAX * 2}, "`initial_scale` must be a finite number > 0 and <= "),
    ({"dynamic_growth_steps": 0}, "`dynamic_growth_steps` must be an integer >= 1. Received: dynamic_growth_steps=0"),
    ({"growth_factor": 1.0}, "`growth_factor` must be a finite number > 1. Received: growth_factor=1.0"),
    ({"backoff_factor": 1.0}, "`backoff_factor` must be a finite number > 0 and < 1. Received: backoff_factor=1.0"),
])
def test_policy_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScalePolicy(**kwargs)


def test_policy_is_frozen():
    with pytest.raises(Exception):
        LossScalePolicy().initial_scale = 3.0
