"""What `dynamic_loss_scale` refuses, and what it takes that optax alone takes oddly.

Every refusal is raised while JAX traces, before anything is computed,
naming the cause; the accepted forms (an `optax.MultiSteps` object,
`lookahead`'s parameter pairs, per-example gradients) run and skip exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale.optax as lso

PARAMS = {"w": jnp.asarray([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.asarray([0.25, -0.5])}


def _grads(scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    return {
        k: jnp.asarray(rng.normal(size=v.shape).astype(np.float32) * scale)
        for k, v in PARAMS.items()
    }


def test_a_scaler_inside_a_scaler_is_refused():
    for inner in (
        lso.dynamic_loss_scale(optax.adam(0.1)),
        optax.chain(optax.clip(1.0), lso.dynamic_loss_scale(optax.adam(0.1))),
    ):
        tx = lso.dynamic_loss_scale(inner)
        with pytest.raises(
            ValueError,
            match=r"`inner` must not itself hold a `dynamic_loss_scale`: the inner one would "
            r"unscale gradients that are no longer scaled.*Received: an inner transformation "
            r"whose state holds 1 DynamicLossScaleState",
        ):
            tx.init(PARAMS)
        with pytest.raises(ValueError, match=r"must not itself hold a `dynamic_loss_scale`"):
            jax.eval_shape(tx.init, PARAMS)


def test_a_state_of_another_inner_transformation_or_tree_is_refused():
    adamw = lso.dynamic_loss_scale(optax.adamw(0.1))
    sgd_state = lso.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9)).init(PARAMS)
    message = (
        r"`state` holds an inner state that this transformation's `inner.init\(params\)` "
        r"would not make: it was made by another inner transformation or for another "
        r"parameter tree. Make the state with this transformation's `init` on these "
        r"parameters. Expected: PyTreeDef\(.*ScaleByAdamState.*Received: PyTreeDef\(.*TraceState"
    )
    with pytest.raises(ValueError, match=message):
        adamw.update(_grads(), sgd_state, PARAMS)
    other = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}  # same tree, other shapes
    with pytest.raises(ValueError, match=r"would not make: it was made by another inner"):
        jax.jit(adamw.update)(
            jax.tree_util.tree_map(jnp.ones_like, other), adamw.init(PARAMS), other
        )


def test_integer_parameters_are_refused_naming_the_cause():
    tx = lso.dynamic_loss_scale(optax.adam(0.1))
    params = {"w": jnp.ones(2), "n": jnp.asarray([1, 2], jnp.int32)}
    grads = {"w": jnp.ones(2), "n": jnp.ones(2)}
    with pytest.raises(
        TypeError,
        match=r"`params` must be floating-point arrays: a loss-scaled step updates them with "
        r"unscaled float gradients, and an integer parameter has none. Leave integer leaves "
        r"out of the tree given to the optimizer \(optax.masked, Flax's `wrt=nnx.Param`, "
        r"Equinox's `eqx.filter`\). Received: \['n'\]: int32",
    ):
        tx.update(grads, tx.init(params), params)


def test_an_optax_multisteps_object_is_its_gradient_transformation():
    def run(inner):
        tx = lso.dynamic_loss_scale(inner, initial_scale=8.0)
        state, out = tx.init(PARAMS), []
        step = jax.jit(tx.update)
        for k in range(5):
            grads = _grads(8.0, seed=k)
            if k == 2:
                grads["w"] = grads["w"].at[0, 0].set(np.inf)
            updates, state = step(grads, state, PARAMS)
            out.append(updates)
        return out, state

    ours, state = run(optax.MultiSteps(optax.adam(0.1), every_k_schedule=2))
    theirs, _ = run(optax.MultiSteps(optax.adam(0.1), every_k_schedule=2).gradient_transformation())
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The overflowing mini-step is not accumulated: 4 of 5 counted.
    assert int(state.inner_state.mini_step) == 0 and int(state.inner_state.gradient_step) == 2


def test_lookahead_takes_its_parameter_pairs():
    tx = lso.dynamic_loss_scale(optax.lookahead(optax.adam(0.1), 2, 0.5), initial_scale=4.0)
    params = optax.LookaheadParams.init_synced(PARAMS)
    state = tx.init(params)
    updates, new = jax.jit(tx.update)(_grads(4.0), state, params)
    alone = optax.lookahead(optax.adam(0.1), 2, 0.5)
    expected, _ = jax.jit(alone.update)(_grads(), alone.init(params), params)
    for a, b in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    telemetry = lso.dynamic_loss_scale(optax.lookahead(optax.adam(0.1), 2, 0.5), telemetry=True)
    assert telemetry.init(params).paths == ("b", "w")  # the fast parameters' paths


def test_per_example_gradients_reach_a_private_aggregate():
    tx = lso.dynamic_loss_scale(
        optax.contrib.differentially_private_aggregate(1.0, 0.0, key=jax.random.key(0)),
        initial_scale=4.0,
    )
    per_example = {k: jnp.stack([g, 2 * g, -g]) for k, g in _grads(4.0).items()}
    updates, state = jax.jit(tx.update)(per_example, tx.init(PARAMS), PARAMS)
    assert jax.tree_util.tree_map(jnp.shape, updates) == jax.tree_util.tree_map(jnp.shape, PARAMS)
    per_example["b"] = per_example["b"].at[1, 0].set(np.nan)
    updates, state = jax.jit(tx.update)(per_example, state, PARAMS)
    assert float(state.scale) == 2.0
    assert all(bool(jnp.all(jnp.signbit(u))) for u in jax.tree_util.tree_leaves(updates))


LIMIT = 64


def _search():
    """An inner update with a loop that runs while a value-dependent condition holds.

    It doubles `x` until it passes the gradients' total magnitude: on an
    infinite gradient that never happens, so the loop is capped at `LIMIT`
    and each run's iteration count is sent to the host.
    """
    iterations = []

    def update(updates, state, params=None):
        total = sum(jnp.sum(jnp.abs(g)) for g in jax.tree_util.tree_leaves(updates))

        def body(carry):
            x, i = carry
            return 2 * x, i + 1

        _, count = jax.lax.while_loop(
            lambda c: (c[0] < total) & (c[1] < LIMIT), body, (jnp.float32(1.0), 0)
        )
        jax.debug.callback(iterations.append, count)
        return jax.tree_util.tree_map(lambda g: -0.1 * g, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update), iterations


def test_a_skipped_step_gives_the_inner_update_finite_gradients():
    """A value-dependent loop (a line search) ends: the inner update never sees inf or NaN."""
    inner, iterations = _search()
    tx = lso.dynamic_loss_scale(inner, initial_scale=4.0)
    step = jax.jit(tx.update)
    state = tx.init(PARAMS)
    _, state = step(_grads(4.0 * 100), state, PARAMS)
    for bad in (np.inf, -np.inf, np.nan):
        grads = _grads(4.0)
        grads["w"] = grads["w"].at[1, 1].set(bad)
        _, state = step(grads, state, PARAMS)
    jax.effects_barrier()
    counts = [int(c) for c in iterations]
    assert 0 < counts[0] < LIMIT  # the applied step searched
    assert counts[1:] == [0, 0, 0]  # the skipped ones saw zeros: nothing to search


def test_float16_parameters_with_adams_default_eps_overflow_as_the_docs_say():
    """Adam's eps (1e-8) and small second moments underflow in float16: 1e-3 / 0 is inf."""
    params = {"w": jnp.full(4, 0.5, jnp.float16)}
    grads = {"w": jnp.full(4, 1e-3 * 1024, jnp.float16)}
    for eps, finite in ((1e-8, False), (1e-4, True)):
        tx = lso.dynamic_loss_scale(optax.adam(1e-3, eps=eps), initial_scale=1024.0)
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        assert bool(jnp.all(jnp.isfinite(updates["w"]))) is finite


def test_train_state_step_counts_skipped_steps_where_optax_count_does_not():
    from flax.training import train_state

    tx = lso.dynamic_loss_scale(optax.adam(0.1), initial_scale=4.0)
    state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    state = step(state, _grads(4.0))
    bad = _grads(4.0)
    bad["b"] = bad["b"].at[0].set(np.inf)
    state = step(state, bad)
    assert int(state.step) == 2  # Flax counts the call
    assert int(state.opt_state.inner_state[0].count) == 1  # optax counts applied steps


def test_nnx_optimizer_step_counts_skipped_steps_too():
    from flax import nnx

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    tx = lso.dynamic_loss_scale(optax.adam(0.1), initial_scale=4.0)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = nnx.state(model, nnx.Param)
    good = jax.tree_util.tree_map(lambda x: jnp.full_like(x, 4.0), grads)
    bad = jax.tree_util.tree_map(lambda x: jnp.full_like(x, jnp.inf), grads)
    optimizer.update(model, good)
    optimizer.update(model, bad)
    assert int(optimizer.step[...]) == 2
    assert int(optimizer.opt_state.inner_state[0].count[...]) == 1
