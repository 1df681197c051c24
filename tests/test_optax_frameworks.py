"""`lossscale.optax.dynamic_loss_scale` in the stacks JAX users train with.

Flax Linen's `TrainState`, Flax NNX's `nnx.Optimizer` and an Equinox loop,
each with float16 compute on float32 parameters and a first loss scale so
high that the float16 backward pass overflows: the first steps are
skipped (parameters and optimizer state unchanged, bit for bit) and the
scale halves until the gradients are finite, then the model learns. Each
jitted step is traced once over all the steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale.optax as lso

STEPS = 20
# 2^24 times a float16 loss gradient overflows float16 (max 65504): the
# first steps are skipped, halving the scale each time.
HIGH_SCALE = 2.0**24


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(x.sum(axis=1, keepdims=True) / 4)


def mse(prediction, y):
    return jnp.mean((prediction.astype(jnp.float32) - y) ** 2)


def tx():
    return lso.dynamic_loss_scale(
        optax.adam(1e-2), initial_scale=HIGH_SCALE, dynamic_growth_steps=100
    )


def bitwise_equal(a, b):
    a, b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(a) == len(b) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b)
    )


def check_trajectory(records):
    """`records`: per step (scale before, scale after, params and inner state changed?)."""
    skipped = [after == before / 2 for before, after, _, _ in records]
    assert any(skipped) and not all(skipped)
    first_applied = skipped.index(False)
    assert all(skipped[:first_applied]) and not any(skipped[first_applied:])
    for (before, after, params_changed, state_changed), skip in zip(records, skipped):
        assert after in (before, before / 2)
        assert params_changed != skip and state_changed != skip
    assert records[first_applied][0] == HIGH_SCALE / 2**first_applied
    return first_applied


def test_flax_linen_train_state_float16_compute():
    import flax.linen as nn
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(16, dtype=jnp.float16)(x))  # float32 parameters
            return nn.Dense(1, dtype=jnp.float16)(x)

    x, y = data()
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx())
    traces = []

    @jax.jit
    def train_step(state, x, y):
        traces.append(1)

        def loss_fn(params):
            loss = mse(state.apply_fn({"params": params}, x), y)
            return lso.scale_loss(loss, state.opt_state), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss

    records, losses = [], []
    for _ in range(STEPS):
        new, loss = train_step(state, x, y)
        records.append(
            (
                float(lso.loss_scale(state)),
                float(lso.loss_scale(new)),
                not bitwise_equal(new.params, state.params),
                not bitwise_equal(new.opt_state.inner_state, state.opt_state.inner_state),
            )
        )
        losses.append(float(loss))
        state = new
    first_applied = check_trajectory(records)
    assert len(traces) == 1
    assert jax.tree_util.tree_leaves(state.params)[0].dtype == jnp.float32
    assert int(state.opt_state.inner_state[0].count) == STEPS - first_applied
    assert losses[-1] < losses[first_applied]
    assert lso.summary(state) == {
        "dynamic_scale": records[-1][1],
        "step_counter": 20 - first_applied,
        "last_step_skipped": False,
    }


def test_flax_nnx_optimizer_under_nnx_jit():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(4, 16, dtype=jnp.float16, rngs=rngs)
            self.out = nnx.Linear(16, 1, dtype=jnp.float16, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(x)))

    x, y = data()
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    traces = []

    @nnx.jit
    def train_step(model, optimizer, x, y):
        traces.append(1)

        def loss_fn(model):
            return lso.scale_loss(mse(model(x), y), optimizer.opt_state)

        optimizer.update(model, nnx.grad(loss_fn)(model))

    def snapshot():
        return (
            jax.tree_util.tree_map(jnp.copy, nnx.state(model, nnx.Param)),
            jax.tree_util.tree_map(jnp.copy, optimizer.opt_state.inner_state),
        )

    records = []
    loss_before = float(mse(model(x), y))
    for _ in range(STEPS):
        before = float(lso.loss_scale(optimizer.opt_state))
        params, inner = snapshot()
        train_step(model, optimizer, x, y)
        new_params, new_inner = snapshot()
        records.append(
            (
                before,
                float(lso.loss_scale(optimizer)),  # found inside the optimizer itself
                not bitwise_equal(new_params, params),
                not bitwise_equal(new_inner, inner),
            )
        )
    first_applied = check_trajectory(records)
    assert len(traces) == 1
    assert float(mse(model(x), y)) < loss_before
    assert lso.summary(optimizer.opt_state)["step_counter"] == STEPS - first_applied
    assert model.hidden.kernel.get_value().dtype == jnp.float32


def test_equinox_under_filter_jit():
    import equinox as eqx

    x, y = data()
    model = eqx.nn.MLP(4, 1, 16, depth=1, key=jax.random.PRNGKey(0))
    optim = tx()
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    traces = []

    def half(model):  # float16 compute on float32 parameters
        return jax.tree_util.tree_map(
            lambda v: v.astype(jnp.float16) if eqx.is_inexact_array(v) else v, model
        )

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        traces.append(1)

        def loss_fn(model):
            return lso.scale_loss(mse(jax.vmap(half(model))(x.astype(jnp.float16)), y), opt_state)

        grads = eqx.filter_grad(loss_fn)(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    records = []
    loss_before = float(mse(jax.vmap(model)(x), y))
    for _ in range(STEPS):
        new_model, new_state = train_step(model, opt_state, x, y)
        records.append(
            (
                float(lso.loss_scale(opt_state)),
                float(lso.loss_scale(new_state)),
                not bitwise_equal(
                    eqx.filter(new_model, eqx.is_array), eqx.filter(model, eqx.is_array)
                ),
                not bitwise_equal(new_state.inner_state, opt_state.inner_state),
            )
        )
        model, opt_state = new_model, new_state
    check_trajectory(records)
    assert len(traces) == 1
    assert float(mse(jax.vmap(model)(x), y)) < loss_before
