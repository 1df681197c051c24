"""`OptimizerState`: a read-only mapping in sorted-name order, and a keyed JAX pytree."""

import numpy as np
import pytest

from lossscale import optimizers
from lossscale.optimizers import LossScaleOptimizer
from lossscale.pytree import OptimizerState, transform


def lso():
    return LossScaleOptimizer(optimizers.Adam(0.05), initial_scale=16.0, dynamic_growth_steps=2)


def test_state_is_a_keyed_pytree():
    import jax
    import jax.numpy as jnp

    tx = transform(lso())
    state = tx.init({"w": jnp.ones(3)})
    paths = [
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]
    ]
    assert paths == [f"[{name!r}]" for name in sorted(tx.names({"w": jnp.ones(3)}))]
    doubled = jax.tree_util.tree_map(lambda x: x * 2, state)
    assert isinstance(doubled, OptimizerState) and float(
        doubled["adam/learning_rate"]
    ) == np.float32(0.1)


def test_a_read_only_mapping_in_sorted_name_order():
    b, a = np.arange(3, dtype=np.float32), np.int64(7)
    state = OptimizerState({"sgd/b": b, "sgd/a": a})
    assert list(state) == ["sgd/a", "sgd/b"] and len(state) == 2
    assert state["sgd/b"] is b and state["sgd/a"] is a  # no copy
    assert dict(state) == {"sgd/a": a, "sgd/b": b} and "sgd/a" in state
    assert not hasattr(state, "__setitem__")
    with pytest.raises(AttributeError):
        state.other = 1  # __slots__: nothing but the values
    with pytest.raises(KeyError, match=r"No optimizer variable named 'sgd/c'. Known: \['sgd/a', "):
        state["sgd/c"]


def test_replace_returns_a_copy_and_names_must_exist():
    state = OptimizerState({"sgd/iteration": np.array(3), "sgd/learning_rate": np.float32(0.1)})
    new = state.replace(**{"sgd/iteration": np.array(4)})
    assert int(new["sgd/iteration"]) == 4 and int(state["sgd/iteration"]) == 3
    assert new["sgd/learning_rate"] is state["sgd/learning_rate"]
    assert list(new) == list(state)
    with pytest.raises(KeyError, match=r"No optimizer variable named 'adam/nope'"):
        state.replace(**{"adam/nope": 1})


def test_repr_names_dtypes_and_shapes_on_each_backend():
    import jax.numpy as jnp
    import torch

    state = OptimizerState(
        {
            "b": torch.zeros(2, 3, dtype=torch.float16),
            "a": np.zeros(4, np.float32),
            "c": jnp.zeros((), jnp.int32),
            "d": 1.5,
        }
    )
    assert repr(state) == (
        "OptimizerState({'a': float32[4], 'b': float16[2, 3], 'c': int32[], 'd': float[]})"
    )


def test_bad_values():
    with pytest.raises(
        TypeError,
        match=r"`values` must be a mapping from names to arrays. "
        r"Received: values of type list",
    ):
        OptimizerState([1, 2])
    with pytest.raises(TypeError, match=r"`values` keys must be strings. Received: key 3"):
        OptimizerState({3: np.ones(1)})


def test_same_names_same_tree_structure():
    """A state rebuilt from a checkpoint's dict has the structure of the one it was saved from."""
    import jax
    import jax.numpy as jnp

    first = OptimizerState({"x": jnp.ones(2), "y": jnp.zeros(3)})
    rebuilt = OptimizerState({"y": np.zeros(3, np.float32), "x": np.ones(2, np.float32)})
    assert jax.tree_util.tree_structure(first) == jax.tree_util.tree_structure(rebuilt)
    assert jax.tree_util.tree_structure(first) != jax.tree_util.tree_structure(
        OptimizerState({"x": jnp.ones(2)})
    )
    leaves = jax.tree_util.tree_leaves(rebuilt)
    np.testing.assert_array_equal(leaves[0], np.ones(2))  # sorted-name order
    traces = []

    @jax.jit
    def step(state):
        traces.append(1)
        return jax.tree_util.tree_map(lambda v: v + 1, state)

    np.testing.assert_array_equal(step(first)["y"], np.ones(3))
    np.testing.assert_array_equal(step(rebuilt)["x"], np.full(2, 2.0))
    assert len(traces) == 1


def test_docstring_examples():
    import doctest

    from lossscale.pytree import _state

    result = doctest.testmod(_state, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
