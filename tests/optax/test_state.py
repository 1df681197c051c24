"""`DynamicLossScaleState`: a named pytree whose static part is the policy."""

import dataclasses
import doctest

import jax
import jax.numpy as jnp
import optax

import lossscale.optax as lso
from lossscale.mixed_precision.loss_scale import LossScaleState
from lossscale.optax import state as state_module


def test_leaves_are_named_and_the_policy_is_static():
    tx = lso.dynamic_loss_scale(optax.adam(0.1), hysteresis=2, telemetry=True)
    state = tx.init({"b": jnp.zeros(2), "w": jnp.ones(2)})
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert names == [
        ".scale",
        ".counter",
        ".consecutive_skips",
        ".steps",
        ".skipped",
        ".last_overflow_step",
        *[f".scale_history[{i}]" for i in range(8)],
        ".nonfinite[0]",
        ".nonfinite[1]",
        ".streak_scale",
        ".persistent_step",
        ".loss_finite",
        *[f".overflow_steps[{i}]" for i in range(8)],
        *[f".overflow_loss[{i}]" for i in range(8)],
        *[f".overflow_cause[{i}]" for i in range(8)],
        ".overflow_bits[0]",
        ".overflow_bits[1]",
        ".last_step_skipped",
        ".inner_state[0].count",
        ".inner_state[0].mu['b']",
        ".inner_state[0].mu['w']",
        ".inner_state[0].nu['b']",
        ".inner_state[0].nu['w']",
    ]
    doubled = jax.tree_util.tree_map(lambda x: x * 2, state)
    assert isinstance(doubled, lso.DynamicLossScaleState)
    assert doubled.policy == state.policy and doubled.paths == ("b", "w")
    assert float(doubled.scale) == 2.0**16
    # Two states of one transformation have one structure: no retrace.
    other = tx.init({"b": jnp.ones(2), "w": jnp.zeros(2)})
    assert jax.tree_util.tree_structure(other) == jax.tree_util.tree_structure(state)
    plain = lso.dynamic_loss_scale(optax.adam(0.1)).init({"b": jnp.zeros(2), "w": jnp.ones(2)})
    assert jax.tree_util.tree_structure(plain) != jax.tree_util.tree_structure(state)
    assert plain.consecutive_skips is None and plain.scale_history == ()


def test_every_loss_scale_field_is_an_attribute():
    state = lso.dynamic_loss_scale(optax.sgd(0.1), min_scale=1.0).init({"w": jnp.ones(1)})
    for f in dataclasses.fields(LossScaleState):
        assert getattr(state, f.name) is getattr(state.loss_scale_state, f.name)
    assert int(state.error) == 0 and int(state.error_step) == -1
    assert repr(state).startswith("DynamicLossScaleState(scale=Array(32768., dtype=float32), ")
    assert repr(state).endswith("inner_state=(EmptyState(), EmptyState()))")


def test_docstring_example():
    result = doctest.testmod(state_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
