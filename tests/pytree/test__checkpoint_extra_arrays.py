"""Checkpoints of pytree states: a file holding arrays the restore target lacks is refused.

`lossscale.saving.restore(tx, path, state=target)` of a `lossscale.pytree`
transform's state or an optax `dynamic_loss_scale` state: a file saved for
more parameters, or with telemetry the target lacks, holds every array the
target has and more. It raises `CheckpointError` naming exactly the extra
arrays (and no missing one), never drops them silently; nothing is
restored, and the target is left as it was.
"""

import ast
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale.optax as lso
from lossscale import saving
from lossscale.optimizers import Adam, LossScaleOptimizer
from lossscale.pytree import transform
from tests.conftest import Backend

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")
SHAPES = {"dense": {"kernel": (256, 128), "bias": (128,)}, "out": (128, 10)}
SCALE = 2.0**10
STEPS = 4  # the step at index 2 overflows


def params_of(make, seed, names=("dense", "out")):
    rng = np.random.default_rng(seed)
    full = {
        "dense": {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES["dense"].items()},
        "out": rng.normal(size=SHAPES["out"]).astype(np.float32),
    }
    return jax.tree_util.tree_map(make, {k: full[k] for k in names})


def gradients(make, step, scale):
    grads = params_of(lambda x: x * np.float32(scale), 100 + step)
    if step == 2:
        grads["out"][3, 7] = np.inf
    return jax.tree_util.tree_map(make, grads)


def lso_transform(telemetry):
    return transform(
        LossScaleOptimizer(
            Adam(0.01), initial_scale=SCALE, dynamic_growth_steps=2, telemetry=telemetry
        )
    )


def optax_transform(telemetry):
    return lso.dynamic_loss_scale(
        optax.adam(0.01), initial_scale=SCALE, dynamic_growth_steps=2, telemetry=telemetry
    )


def leaves_named(kind, state):
    """`{name: array}`: the names `lossscale.saving` writes a state's arrays under."""
    if kind == "transform":
        return dict(state)
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def numpy_leaves(backend, kind, state):
    return {n: np.array(backend.numpy(x)) for n, x in leaves_named(kind, state).items()}


def trained_state(backend, kind, telemetry):
    """`(tx, state)` after `STEPS` steps over both layers, skipped step included."""
    make = backend.array
    params = params_of(make, 0)
    if kind == "transform":
        tx = lso_transform(telemetry)
        state = tx.init(params)
        for k in range(STEPS):
            scale = backend.numpy(tx.loss_scale(state))
            params, state = tx.apply(gradients(make, k, scale), state, params)
        return tx, state
    tx = optax_transform(telemetry)
    state = tx.init(params)
    for k in range(STEPS):
        grads = gradients(make, k, lso.loss_scale(state))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return tx, state


def bits(x):
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def unexpected_in(message):
    """The lists the error names: `(missing, unexpected)`."""
    found = re.search(r"Missing: (\[.*?\])\. Unexpected: (\[.*\])", message)
    assert found, message
    return ast.literal_eval(found.group(1)), ast.literal_eval(found.group(2))


# (backend, kind): the transform on NumPy, torch and JAX; optax on JAX.
KINDS = [("numpy", "transform"), ("torch", "transform"), ("jax", "transform"), ("jax", "optax")]
# What the target lacks: the second layer's parameters; the telemetry's state; both.
TARGETS = {
    "fewer_params": (("dense",), True),
    "no_telemetry": (("dense", "out"), False),
    "fewer_params_no_telemetry": (("dense",), False),
}


@pytest.mark.parametrize("target_case", sorted(TARGETS))
@pytest.mark.parametrize("backend_name,kind", KINDS)
def test_a_file_with_extra_arrays_is_refused_naming_them(backend_name, kind, target_case, tmp_path):
    backend = Backend(backend_name)
    tx, state = trained_state(backend, kind, telemetry=True)
    path = tmp_path / "state.safetensors"
    saving.save(tx, path, state=state)
    saved = numpy_leaves(backend, kind, state)

    names, telemetry = TARGETS[target_case]
    target_tx = lso_transform(telemetry) if kind == "transform" else optax_transform(telemetry)
    target = target_tx.init(params_of(backend.array, 1, names))
    target_names = set(leaves_named(kind, target))
    extra = set(saved) - target_names
    # Only extra arrays: every array of the target is in the file, shaped alike.
    assert extra and target_names <= set(saved)
    for name, x in numpy_leaves(backend, kind, target).items():
        assert x.shape == saved[name].shape and x.dtype == saved[name].dtype, name
    before = numpy_leaves(backend, kind, target)

    with pytest.raises(saving.CheckpointError) as raised:
        saving.restore(target_tx, path, state=target)
    message = str(raised.value)
    assert str(path) in message
    assert "its arrays do not match the target state's" in message
    missing, unexpected = unexpected_in(message)
    assert missing == []
    assert sorted(unexpected) == sorted(extra) and len(unexpected) == len(extra)
    # Nothing restored: the target holds what it held.
    after = numpy_leaves(backend, kind, target)
    assert after.keys() == before.keys()
    for name, x in before.items():
        assert x.dtype == after[name].dtype
        assert np.array_equal(bits(x), bits(after[name])), name

    # The control: the same file restores into a target that has exactly its arrays.
    full = tx.init(params_of(backend.array, 1))
    restored = saving.restore(tx, path, state=full)
    for name, x in numpy_leaves(backend, kind, restored).items():
        assert np.array_equal(bits(x), bits(saved[name])), name


@pytest.mark.parametrize("kind", ["transform", "optax"])
def test_an_abstract_target_is_refused_the_same_way(kind, tmp_path):
    # A target from `jax.eval_shape`, as a resumed jitted run builds it.
    backend = Backend("jax")
    tx, state = trained_state(backend, kind, telemetry=False)
    path = tmp_path / "state.safetensors"
    saving.save(tx, path, state=state)
    target_tx = lso_transform(False) if kind == "transform" else optax_transform(False)
    params = params_of(jnp.asarray, 1, ("dense",))
    abstract = jax.eval_shape(target_tx.init, params)
    with pytest.raises(saving.CheckpointError) as raised:
        saving.restore(target_tx, path, state=abstract)
    missing, unexpected = unexpected_in(str(raised.value))
    assert missing == []
    expected = (
        ["adam/out_momentum", "adam/out_velocity"]
        if kind == "transform"
        else [".inner_state[0].mu['out']", ".inner_state[0].nu['out']"]
    )
    assert sorted(unexpected) == expected
