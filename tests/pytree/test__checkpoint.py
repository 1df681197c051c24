"""Checkpoints of pytree states: `lossscale.saving` for transforms and optax states, and orbax.

A run interrupted by a checkpoint and resumed from it (into a fresh
transform, from an abstract `jax.eval_shape` target) equals the
uninterrupted run bit for bit, skipped steps included.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
import lossscale.optax as lso
from lossscale import saving
from lossscale.optimizers import SGD, Adam, LossScaleOptimizer
from lossscale.pytree import OptimizerState, transform

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")
SHAPES = {"dense": {"kernel": (5, 3), "bias": (3,)}, "out": (3,)}
STEPS, SAVE_AT = 10, 5
SCALE = 64.0


def tree(make, seed):
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            k: make(rng.normal(size=s).astype(np.float32)) for k, s in SHAPES["dense"].items()
        },
        "out": make(rng.normal(size=SHAPES["out"]).astype(np.float32)),
    }


def gradients(make, step, scale):
    grads = tree(lambda x: x * np.float32(scale), 100 + step)
    if step % 4 == 2:  # steps 2 and 6 overflow
        grads["out"][1] = np.inf if step == 2 else np.nan
    return jax.tree_util.tree_map(make, grads) if make is not None else grads


def lso_transform(inner=None):
    return transform(
        LossScaleOptimizer(inner or Adam(0.05), initial_scale=SCALE, dynamic_growth_steps=2)
    )


def assert_bitwise(a, b):
    a_leaves, b_leaves = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(a_leaves, b_leaves):
        x, y = np.asarray(_numpy(x)), np.asarray(_numpy(y))
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def _numpy(x):
    return x.detach().numpy() if hasattr(x, "detach") else x


# --- lossscale.pytree transforms ------------------------------------------------
def test_transform_resumes_bit_for_bit(backend, tmp_path):
    make = backend.array
    tx = lso_transform()
    step = tx.jit() if backend.name == "jax" else tx.apply
    params = tree(make, 0)
    state = tx.init(params)
    path = tmp_path / "state.safetensors"
    for k in range(STEPS):
        if k == SAVE_AT:
            saving.save(tx, path, state=state)
            saved_params = jax.tree_util.tree_map(lambda x: make(backend.numpy(x)), params)
        params, state = step(gradients(make, k, backend.numpy(tx.loss_scale(state))), state, params)
    # A fresh transform and optimizer; the target only gives structure and placement.
    fresh = lso_transform()
    target = fresh.init(saved_params)
    if backend.name == "jax":
        target = jax.eval_shape(fresh.init, saved_params)
    resumed = saving.restore(fresh, path, state=target)
    assert isinstance(resumed, OptimizerState) and sorted(resumed) == sorted(state)
    resumed_params = saved_params
    step = fresh.jit() if backend.name == "jax" else fresh.apply
    for k in range(SAVE_AT, STEPS):
        grads = gradients(make, k, backend.numpy(fresh.loss_scale(resumed)))
        resumed_params, resumed = step(grads, resumed, resumed_params)
    assert_bitwise(resumed_params, params)
    assert_bitwise(dict(resumed), dict(state))
    assert int(backend.numpy(state["adam/iteration"])) == STEPS - 2


def test_the_transforms_optimizer_is_never_saved_stale(tmp_path):
    """Issue 13: `save(tx.optimizer)` after `tx.apply`, donated buffers included, is an error."""
    tx = lso_transform()
    params = tree(jnp.asarray, 0)
    state = tx.init(params)
    step = tx.jit()
    for k in range(4):
        old_state = state
        params, state = step(gradients(jnp.asarray, k, tx.loss_scale(state)), state, params)
    path = tmp_path / "opt.safetensors"
    message = (
        r"This optimizer was given to lossscale.pytree.transform, which never builds or writes "
        r"it: the training state is the `state` pytree that `tx.init` and `tx.apply` return. "
        r"Save that instead, lossscale.saving.save\(tx, path, state=state\), and restore it with "
        r"lossscale.saving.restore\(tx, path, state=tx.init\(params\)\)"
    )
    with pytest.raises(ValueError, match=message):
        saving.save(tx.optimizer, path)
    with pytest.raises(ValueError, match=message):
        saving.restore(tx.optimizer, path)
    with pytest.raises(ValueError, match=r"pass the state to save.*Received: state=None"):
        saving.save(tx, path)
    with pytest.raises(
        ValueError,
        match=r"`state` holds arrays that were donated to a jitted step and no longer exist "
        r"\('adam/dense_bias_momentum'\): save the state that step returned",
    ):
        saving.save(tx, path, state=old_state)
    with pytest.raises(ValueError, match=r"`state` is traced \(inside jax.jit"):
        jax.jit(lambda s: saving.save(tx, path, state=s))(state)
    built = LossScaleOptimizer(SGD(0.1))
    built.build([ls.Variable(np.ones(2, np.float32))])
    with pytest.raises(ValueError, match=r"`state` is for transforms, whose state is a pytree"):
        saving.save(built, path, state=state)
    assert not list(tmp_path.iterdir())
    saving.save(tx, path, state=state)  # the way that works
    restored = saving.restore(tx, path, state=tx.init(params))
    assert_bitwise(dict(restored), dict(state))


# --- optax states: lossscale.saving and orbax --------------------------------------
def optax_run(tx, params, state, steps, step):
    for k in steps:
        params, state = step(params, state, gradients(jnp.asarray, k, lso.loss_scale(state)))
    return params, state


@pytest.mark.parametrize("via", ["lossscale.saving", "orbax"])
def test_optax_state_resumes_bit_for_bit_from_an_abstract_target(via, tmp_path):
    inner = optax.chain(
        optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=0.01)
    )
    tx = lso.dynamic_loss_scale(inner, initial_scale=SCALE, dynamic_growth_steps=2, telemetry=True)
    traces = []

    def apply(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(apply, donate_argnums=(0, 1))
    params = tree(jnp.asarray, 0)
    params, state = optax_run(tx, params, tx.init(params), range(SAVE_AT), step)
    saved_params = jax.tree_util.tree_map(np.array, params)
    abstract = jax.eval_shape(tx.init, params)
    if via == "orbax":
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp_path / "ckpt", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    else:
        saving.save(tx, tmp_path / "state.safetensors", state=state)
        restored = saving.restore(tx, tmp_path / "state.safetensors", state=abstract)
    assert isinstance(restored, lso.DynamicLossScaleState)
    params, state = optax_run(tx, params, state, range(SAVE_AT, STEPS), step)
    resumed_params, resumed = optax_run(
        tx, jax.tree_util.tree_map(jnp.asarray, saved_params), restored, range(SAVE_AT, STEPS), step
    )
    assert_bitwise(resumed_params, params)
    assert_bitwise(resumed, state)
    assert len(traces) == 1  # the restored state fits the compiled step
    summary = lso.summary(resumed)
    assert summary["skipped_steps"] == 2 and summary["nonfinite_variables"] == ["out"]


# --- bad files and mismatched targets ------------------------------------------------
def test_restore_errors(tmp_path):
    tx = lso_transform()
    params = tree(jnp.asarray, 0)
    state = tx.init(params)
    path = tmp_path / "state.safetensors"
    saving.save(tx, path, state=state)
    optax_tx = lso.dynamic_loss_scale(optax.adam(0.1))
    optax_path = tmp_path / "optax.safetensors"
    saving.save(optax_tx, optax_path, state=optax_tx.init(params))
    optimizer_path = tmp_path / "optimizer.safetensors"
    variables = [ls.Variable(x) for x in jax.tree_util.tree_leaves(params)]
    built = LossScaleOptimizer(Adam(0.05))
    built.build(variables)
    saving.save(built, optimizer_path)
    other_model = {"w": jnp.ones(3)}
    other_shapes = {"dense": {"kernel": jnp.ones((4, 3)), "bias": jnp.ones(3)}, "out": jnp.ones(3)}
    int_target = state.replace(**{"adam/dense_bias_momentum": jnp.zeros(3, jnp.int32)})
    cases = [
        (
            lambda: saving.restore(optax_tx, path, state=optax_tx.init(params)),
            r"it holds the state of a transform of LossScaleOptimizer\(Adam\), not of this "
            r"optax transformation",
        ),
        (
            lambda: saving.restore(lso_transform(SGD(0.1)), path, state=state),
            r"it holds the state of a transform of LossScaleOptimizer\(Adam\), not of this "
            r"transform of LossScaleOptimizer\(SGD\)",
        ),
        (
            lambda: saving.restore(tx, optax_path, state=state),
            r"it holds the state of a optax transformation, not of this transform",
        ),
        (
            lambda: saving.restore(tx, path, state=tx.init(other_model)),
            r"its arrays do not match the target state's \(saved for another model or other "
            r"settings\). Missing: \['adam/w_momentum', 'adam/w_velocity'\]. Unexpected: "
            r"\['adam/dense_bias_momentum'",
        ),
        (
            lambda: saving.restore(tx, path, state=tx.init(other_shapes)),
            r"'adam/dense_kernel_momentum' has shape \(5, 3\) but the target's has shape \(4, 3\)",
        ),
        (
            lambda: saving.restore(tx, path, state=int_target),
            r"'adam/dense_bias_momentum' holds float32 values but the target's is int32",
        ),
        (
            lambda: saving.load(path, variables),
            r"not a lossscale optimizer checkpoint \(metadata 'format' is 'lossscale.state', "
            r"expected 'lossscale.optimizer'\); it holds a transform's state: restore it with "
            r"lossscale.saving.restore\(tx, path, state=target\)",
        ),
        (
            lambda: saving.restore(tx, optimizer_path, state=state),
            r"not a lossscale state checkpoint \(metadata 'format' is 'lossscale.optimizer', "
            r"expected 'lossscale.state'\); it holds an optimizer's variables: restore it with "
            r"lossscale.saving.restore\(optimizer, path\) or load\(path, variables\)",
        ),
    ]
    for call, message in cases:
        with pytest.raises(saving.CheckpointError, match=message):
            call()
    with pytest.raises(ValueError, match=r"`state` is required to restore a transform's state"):
        saving.restore(tx, path)
    with pytest.raises(
        TypeError,
        match=r"`state` must be the OptimizerState of the transform. Received: state of type dict",
    ):
        saving.restore(tx, path, state=dict(state))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(saving.CheckpointError, match=r"is corrupt: its bytes do not match"):
        saving.restore(tx, path, state=state)
