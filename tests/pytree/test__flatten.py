"""Flattening parameter trees: without JAX, with JAX's leaf order, paths and error text."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from lossscale.pytree import _flatten


def tree():
    a = np.zeros(1, np.float32)
    return {
        "dense": {"kernel": np.ones((2, 3)), "bias": np.ones(3)},
        "out": [np.full(2, 2.0), (a, None)],
        "b": None,
        "a": [],
    }


def test_both_ways_give_the_same_leaves_and_paths():
    import jax

    built = tree()
    leaves, treedef, paths = _flatten.flatten(built, "params", use_jax=False)
    jax_leaves, jax_treedef, jax_paths = _flatten.flatten(built, "params", use_jax=True)
    assert paths == jax_paths == ["dense/bias", "dense/kernel", "out/0", "out/1/0"]
    assert [id(x) for x in leaves] == [id(x) for x in jax_leaves]
    assert jax_leaves == jax.tree_util.tree_leaves(built)
    # The structure prints as JAX's does (inside its `PyTreeDef(...)`).
    assert (
        repr(treedef)
        == "{'a': [], 'b': None, 'dense': {'bias': *, 'kernel': *}, 'out': [*, (*, None)]}"
    )
    assert repr(jax_treedef) == f"PyTreeDef({treedef!r})"


def test_unflatten_builds_the_same_containers():
    leaves, treedef, _ = _flatten.flatten(tree(), "params", use_jax=False)
    new = _flatten.unflatten(treedef, [x * 2 for x in leaves])
    assert type(new["out"]) is list and type(new["out"][1]) is tuple
    assert new["b"] is None and new["a"] == [] and new["out"][1][1] is None
    np.testing.assert_array_equal(new["dense"]["kernel"], np.full((2, 3), 2.0))
    np.testing.assert_array_equal(new["out"][0], np.full(2, 4.0))
    _, jax_treedef, _ = _flatten.flatten(tree(), "params", use_jax=True)
    again = _flatten.unflatten(jax_treedef, leaves)
    assert repr(_flatten.flatten(again, "params", use_jax=False)[1]) == repr(treedef)


def test_structures_compare_by_shape_of_the_tree():
    def structure(t):
        return _flatten.flatten(t, "grads", use_jax=False)[1]

    one = np.ones(1)
    assert structure({"a": one, "b": [one]}) == structure({"b": [one * 2], "a": one})
    assert hash(structure({"a": one})) == hash(structure({"a": one * 3}))
    assert structure({"a": [one]}) != structure({"a": (one,)})
    assert structure({"a": one}) != structure({"b": one})
    assert structure([one, None]) != structure([one])


@pytest.mark.parametrize("use_jax", [False, True])
def test_a_tree_without_arrays_is_refused(use_jax):
    if use_jax:
        import jax  # noqa: F401
    with pytest.raises(
        ValueError, match=r"`grads` must hold at least one array. Received: grads=\{'a': \[\]\}"
    ):
        _flatten.flatten({"a": []}, "grads", use_jax)


_NO_JAX = textwrap.dedent("""
    import sys, json
    import numpy as np
    import lossscale as ls, lossscale.pytree as lp
    assert "jax" not in sys.modules and "torch" not in sys.modules
    tx = lp.transform(ls.optimizers.SGD(0.5))
    params = {"b": (np.ones(2, np.float32), None), "a": [np.zeros(1, np.float32)]}
    state = tx.init(params)
    grads = {"b": (np.full(2, 2.0, np.float32), None), "a": [np.ones(1, np.float32)]}
    new, state = tx.apply(grads, state, params)
    try:
        tx.apply({"a": [np.ones(1, np.float32)]}, state, params)
    except ValueError as e:
        error = str(e)
    assert "jax" not in sys.modules
    import jax  # imported later: trees are then flattened by jax.tree_util, same names
    again, _ = tx.apply(grads, state, params)
    assert again["a"][0].tolist() == [-0.5]
    print(json.dumps({"new": {"a": new["a"][0].tolist(), "b": new["b"][0].tolist(),
                              "b_type": type(new["b"]).__name__, "none": new["b"][1]},
                      "names": tx.names(params), "iteration": int(state["sgd/iteration"]),
                      "error": error}))
""")


def test_without_jax_nested_containers_work():
    """NumPy trees flatten without importing JAX, with JAX's leaf order and error text."""
    out = subprocess.run(
        [sys.executable, "-c", _NO_JAX], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout)
    assert result["new"] == {"a": [-0.5], "b": [0.0, 0.0], "b_type": "tuple", "none": None}
    assert result["names"] == ["sgd/iteration", "sgd/learning_rate"]
    assert result["iteration"] == 1
    assert result["error"] == (
        "`grads` must have the structure of `params`. Expected: "
        "{'a': [*], 'b': (*, None)}. Received: {'a': [*]}"
    )
