"""`lossscale.optax.dynamic_loss_scale`: the optax transformation, against optax + jmp.

The reference is what a JAX user writes today: jmp's `DynamicLossScale`
for the scale and `jmp.select_tree` for the skip, around the same optax
transformation. Scales are powers of two, so unscaling is exact and the
two agree bit for bit where XLA fuses the same arithmetic.
"""

import doctest
import subprocess
import sys

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import lossscale as ls
import lossscale.optax as lso
from lossscale.mixed_precision import LossScaleError
from lossscale.optax import transform as transform_module

SHAPES = {"dense": {"kernel": (4, 3), "bias": (3,)}, "out": (3,)}
STEPS = 20
BAD_STEPS = {3: np.inf, 4: np.nan, 11: -np.inf}  # two in a row: the scale halves twice
INITIAL_SCALE, GROWTH_STEPS = 2.0**10, 3


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.normal(size=s).astype(np.float32)),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def unscaled_grads(seed=1):
    """One gradient tree per step (finite, ~N(0, 2)); bad steps get a non-finite entry later."""
    rng = np.random.default_rng(seed)
    return [
        jax.tree_util.tree_map(
            lambda s: jnp.asarray(2 * rng.normal(size=s).astype(np.float32)),
            SHAPES,
            is_leaf=lambda x: isinstance(x, tuple),
        )
        for _ in range(STEPS)
    ]


def scaled(grads, step, scale):
    grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
    if step in BAD_STEPS:
        grads["out"] = grads["out"].at[1].set(BAD_STEPS[step])
    return grads


def inner():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.01, weight_decay=0.1))


def assert_bitwise(ours, theirs):
    ours, theirs = jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def optax_jmp_run(params):
    """The user's loop with optax + jmp; returns per-step (params, scale, inner state)."""
    tx = inner()
    opt_state = tx.init(params)
    loss_scale = jmp.DynamicLossScale(jnp.float32(INITIAL_SCALE), period=GROWTH_STEPS)

    @jax.jit
    def step(params, opt_state, loss_scale, grads):
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, loss_scale.adjust(finite)

    out = []
    for k, g in enumerate(unscaled_grads()):
        params, opt_state, loss_scale = step(
            params, opt_state, loss_scale, scaled(g, k, loss_scale.loss_scale)
        )
        out.append((params, float(loss_scale.loss_scale), opt_state))
    return out


def lossscale_run(params, **settings):
    tx = lso.dynamic_loss_scale(
        inner(), initial_scale=INITIAL_SCALE, dynamic_growth_steps=GROWTH_STEPS, **settings
    )
    state = tx.init(params)
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    out = []
    for k, g in enumerate(unscaled_grads()):
        params, state = step(params, state, scaled(g, k, lso.loss_scale(state)))
        out.append((params, state))
    return out, traces


# --- the trajectory -----------------------------------------------------------
def test_scale_and_parameters_follow_optax_and_jmp():
    ours, traces = lossscale_run(make_params())
    theirs = optax_jmp_run(make_params())
    scales = [float(lso.loss_scale(state)) for _, state in ours]
    assert scales == [jmp_scale for _, jmp_scale, _ in theirs]
    # 2^10, 2^11 after 3 finite steps, halved twice by steps 3 and 4, ...
    assert scales[:6] == [1024.0, 1024.0, 2048.0, 1024.0, 512.0, 512.0]
    for (params, state), (ref_params, _, ref_inner) in zip(ours, theirs):
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        assert int(state.inner_state[1][0].count) == int(ref_inner[1][0].count)
    assert int(ours[-1][1].inner_state[1][0].count) == STEPS - len(BAD_STEPS)
    assert len(traces) == 1  # 20 steps, skips included, one trace


def test_skipped_steps_change_nothing_bitwise():
    """Parameters (-0.0 ones included) and the whole inner state stay as they were."""
    tx = lso.dynamic_loss_scale(inner(), initial_scale=INITIAL_SCALE)
    params = make_params()
    params["out"] = jnp.asarray([-0.0, 0.0, -1.5])
    state = tx.init(params)
    grads = scaled(unscaled_grads()[0], 0, INITIAL_SCALE)
    params, state = jax.jit(lambda p, s, g: _step(tx, p, s, g))(params, state, grads)
    params["out"] = jnp.asarray([-0.0, 0.0, -1.5])
    step = jax.jit(lambda p, s, g: _step(tx, p, s, g, keep_updates=True))
    for bad in (np.inf, -np.inf, np.nan):
        grads = scaled(unscaled_grads()[1], 1, INITIAL_SCALE)
        grads["dense"]["kernel"] = grads["dense"]["kernel"].at[2, 1].set(bad)
        new_params, new_state, updates = step(params, state, grads)
        assert_bitwise(new_params, params)
        assert np.signbit(np.asarray(new_params["out"])).tolist() == [True, False, True]
        assert_bitwise(new_state.inner_state, state.inner_state)
        # The update of a skipped step is -0.0: p + (-0.0) is p for every p.
        for u in jax.tree_util.tree_leaves(updates):
            assert np.all(np.asarray(u) == 0) and np.all(np.signbit(np.asarray(u)))
        assert float(new_state.scale) == float(state.scale) / 2
        assert int(new_state.counter) == 0
    # Why not +0.0: it would flip a -0.0 parameter's sign.
    assert not np.signbit(np.float32(-0.0) + np.float32(0.0))


def _step(tx, params, state, grads, keep_updates=False):
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    return (new, state, updates) if keep_updates else (new, state)


@pytest.mark.parametrize(
    "settings",
    [
        dict(hysteresis=2, growth_factor=4.0, backoff_factor=0.25),
        dict(max_scale=2048.0, telemetry=True),
        dict(max_consecutive_skips=1, min_scale=8.0),
    ],
    ids=["hysteresis", "max_scale_telemetry", "fail_fast"],
)
def test_the_scale_is_lossscales_one_state_machine(settings):
    """Beyond-Keras settings: the scale follows LossScaleOptimizer's on the same gradients."""
    ours, _ = lossscale_run(make_params(), **settings)
    reference = ls.LossScaleOptimizer(
        ls.optimizers.SGD(0.0),
        initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS,
        **settings,
    )
    variables = [
        ls.Variable(np.array(x), name=path)
        for path, x in zip(
            ("dense/bias", "dense/kernel", "out"), jax.tree_util.tree_leaves(make_params())
        )
    ]
    reference.scale_loss(1.0)
    for k, (g, (_, state)) in enumerate(zip(unscaled_grads(), ours)):
        scale = float(reference.dynamic_scale)
        grads = [np.asarray(x) for x in jax.tree_util.tree_leaves(scaled(g, k, scale))]
        try:
            reference.apply(grads, variables)
        except LossScaleError:
            pass
        assert lso.summary(state) == reference.summary(), k


def test_a_gradient_that_overflows_when_unscaled_is_an_overflow():
    tiny = float(np.finfo(np.float32).tiny)  # the smallest scale a backoff reaches
    tx = lso.dynamic_loss_scale(optax.sgd(0.1), initial_scale=tiny)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.full(2, 1e3)}, state, params)  # finite, scaled
    assert np.all(np.signbit(np.asarray(updates["w"])))  # 1e3 / tiny is inf: skipped
    assert float(state.scale) == tiny and int(state.counter) == 0


def test_overflow_is_judged_in_the_dtype_a_gradient_is_unscaled_to():
    """60000 / 0.5 leaves float16's range but not float32's."""
    tx = lso.dynamic_loss_scale(optax.sgd(1.0), initial_scale=0.5)
    grads = {"w": jnp.asarray([6e4, 1.0], jnp.float16)}
    for param_dtype, applied in (("float16", False), ("float32", True)):
        params = {"w": jnp.zeros(2, param_dtype)}
        for update in (tx.update, jax.jit(tx.update)):
            updates, state = update(grads, tx.init(params), params)
            assert bool(np.all(np.isfinite(np.asarray(updates["w"])))) and (
                float(state.scale) == (0.5 if applied else 0.25)
            ), (param_dtype, update)


@pytest.mark.parametrize(
    "values, applied",
    [([3e38, 3e38], True), ([2.0, np.inf], False), ([np.inf, -np.inf], False)],
)
def test_large_gradients_checked_by_their_sums_decide_as_their_peaks(values, applied, monkeypatch):
    """A sum that overflows is not an overflow of the gradients; inf and NaN are."""
    from lossscale.backends.jax import multi as jax_multi

    monkeypatch.setattr(jax_multi, "_SUMMED", 4)
    tx = lso.dynamic_loss_scale(optax.sgd(1e-40), initial_scale=1.0)
    params = {"w": jnp.zeros(8), "b": jnp.zeros(2)}
    grads = {"w": jnp.asarray(np.resize(values, 8), jnp.float32), "b": jnp.ones(2)}
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert float(state.scale) == (1.0 if applied else 0.5)
    jaxpr = str(jax.make_jaxpr(tx.update)(grads, tx.init(params), params))
    assert "reduce_sum" in jaxpr  # checked by its sum (SGD itself sums nothing)
    assert int(state.counter) == (1 if applied else 0)


def test_headroom_policy_grows_only_with_room():
    tx = lso.dynamic_loss_scale(
        optax.sgd(0.1), initial_scale=2.0**14, dynamic_growth_steps=1, growth_policy="headroom"
    )
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: _step(tx, p, s, g))
    _, state = step(params, state, {"w": jnp.full(2, 2.0**-8) * 2.0**14})  # peak 64: room
    assert float(state.scale) == 2.0**15
    _, state = step(params, state, {"w": jnp.full(2, 2.0**-2) * 2.0**15})  # peak 8192: none
    assert float(state.scale) == 2.0**15


def test_half_precision_gradients_are_unscaled_in_the_parameters_dtype():
    tx = lso.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0**10)
    small = jnp.asarray([3e-6, -2e-5, 5e-3], jnp.float32)  # flush or round in float16
    for param_dtype, expected in (("float32", "float32"), ("float16", "float16")):
        params = {"w": jnp.zeros(3, param_dtype)}
        state = tx.init(params)
        grads = {"w": (small * 2.0**10).astype(jnp.float16)}
        updates, _ = tx.update(grads, state, params)
        assert updates["w"].dtype == expected
        exact = -(grads["w"].astype(jnp.float32) / 2.0**10).astype(expected)
        np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(exact))
    # Without params, the gradient's own dtype.
    updates, _ = tx.update(grads, tx.init(grads))
    assert updates["w"].dtype == jnp.float16


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_unscaling_by_the_reciprocal_is_division_bit_for_bit(dtype):
    """Every power of two a default policy reaches, against float64 division."""
    unscale = transform_module._unscaler(ls.mixed_precision.LossScalePolicy())
    rng = np.random.default_rng(7)
    finfo = jnp.finfo(dtype)
    grads = (rng.normal(size=4000) * np.exp2(rng.integers(-24, 16, 4000))).astype(np.float32)
    grads = jnp.asarray(np.clip(grads, -float(finfo.max), float(finfo.max))).astype(dtype)
    wide = np.asarray(grads.astype(jnp.float32)).astype(np.float64)
    step = jax.jit(lambda g, s: unscale([g], ["float32"], s)[0])
    for k in range(-126, 128):
        ours = np.asarray(step(grads, jnp.float32(2.0**k)))
        with np.errstate(over="ignore"):  # quotients past float32's range are inf
            exact = (wide / 2.0**k).astype(np.float32)
        # XLA's CPU code may flush subnormal results to zero (it does for
        # division too); every normal result must be the quotient exactly.
        normal = np.abs(exact) >= np.finfo(np.float32).tiny
        np.testing.assert_array_equal(ours[normal], exact[normal])
        assert np.all((ours[~normal] == exact[~normal]) | (ours[~normal] == 0))
        assert np.array_equal(np.signbit(ours), np.signbit(exact))


@pytest.mark.parametrize(
    "settings, powers",
    [
        ({}, True),
        (dict(growth_factor=4.0, backoff_factor=0.25, max_scale=2.0**20), True),
        (dict(initial_scale=1000.0), False),
        (dict(growth_factor=3.0), False),
        (dict(backoff_factor=0.75), False),
        (dict(initial_scale=1024.0, max_scale=3000.0), False),
        # The floor itself (a subnormal scale is refused: its reciprocal is inf).
        (dict(initial_scale=2.0**-126), True),
    ],
)
def test_only_power_of_two_policies_unscale_by_the_reciprocal(settings, powers):
    policy = ls.mixed_precision.LossScalePolicy(**settings)
    assert policy.scales_are_powers_of_two is powers
    unscale = jax.jit(lambda g, s: transform_module._unscaler(policy)([g], ["float32"], s)[0])
    grads = jnp.asarray(np.random.default_rng(8).normal(size=4000).astype(np.float32))
    scale = jnp.float32(policy.initial_scale)
    if powers:  # exact: the correctly rounded quotient
        expected = (np.asarray(grads).astype(np.float64) / policy.initial_scale).astype(np.float32)
    else:  # JAX's own division, whatever XLA makes of it (on CPU: not always IEEE)
        expected = np.asarray(jax.jit(jnp.divide)(grads, scale))
    np.testing.assert_array_equal(np.asarray(unscale(grads, scale)), expected)


# --- purity: jit, vmap, eval_shape ----------------------------------------------
def test_init_is_pure():
    tx = lso.dynamic_loss_scale(inner(), telemetry=True)
    params = make_params()
    eager = tx.init(params)
    abstract = jax.eval_shape(tx.init, params)
    traced = jax.jit(tx.init)(params)
    assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(eager)
    assert_bitwise(traced, eager)
    for a, b in zip(jax.tree_util.tree_leaves(abstract), jax.tree_util.tree_leaves(eager)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert eager.paths == ("dense/bias", "dense/kernel", "out")
    assert float(eager.scale) == 2.0**15 and eager.scale.dtype == jnp.float32
    assert eager.counter.dtype == jnp.int32 and eager.last_overflow_step == -1


def test_vmap_over_an_ensemble_decides_per_member():
    tx = lso.dynamic_loss_scale(optax.adam(0.01), initial_scale=16.0)
    members = [make_params(0), make_params(1)]
    stacked = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), *members)
    grads = [scaled(unscaled_grads()[0], 0, 16.0), scaled(unscaled_grads()[3], 3, 16.0)]
    stacked_grads = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), *grads)
    states = jax.vmap(tx.init)(stacked)
    new_params, new_states = jax.jit(jax.vmap(lambda p, s, g: _step(tx, p, s, g)))(
        stacked, states, stacked_grads
    )
    np.testing.assert_array_equal(np.asarray(new_states.scale), [16.0, 8.0])
    for k in range(2):
        alone, _ = _step(tx, members[k], tx.init(members[k]), grads[k])
        for a, b in zip(jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(alone)):
            np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_extra_arguments_reach_the_inner_transformation():
    plateau = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0))
    tx = lso.dynamic_loss_scale(plateau, initial_scale=4.0)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    for loss in (1.0, 2.0, 3.0):
        _, state = tx.update({"w": jnp.full(2, 4.0)}, state, params, value=jnp.asarray(loss))
    # The loss rose: optax's plateau rule cut its scale below 1.
    assert float(state.inner_state[1].scale) < 1.0


def test_python_extra_arguments_stay_python_values():
    """As in a direct call: an inner update may branch on a plain Python argument."""

    def update(updates, state, params=None, *, boost=1):
        factor = 10.0 if boost > 1 else 1.0  # a Python branch: `boost` must not be traced
        return jax.tree_util.tree_map(lambda g: -factor * g, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    tx = lso.dynamic_loss_scale(inner, initial_scale=4.0)
    params = {"w": jnp.ones(2)}
    updates, _ = jax.jit(lambda s: tx.update({"w": jnp.full(2, 4.0)}, s, params, boost=2))(
        tx.init(params)
    )
    np.testing.assert_array_equal(np.asarray(updates["w"]), [-10.0, -10.0])


# --- bad input -----------------------------------------------------------------
def test_errors():
    tx = lso.dynamic_loss_scale(optax.adam(0.1), telemetry=True)
    params = {"w": jnp.ones(2), "b": jnp.ones(3)}
    state = tx.init(params)
    grads = {"w": jnp.ones(2), "b": jnp.ones(3)}
    cases = [
        (
            lambda: lso.dynamic_loss_scale("adam"),
            ValueError,
            r"`inner` must be an optax.GradientTransformation, such as optax.adam\(1e-3\), "
            r"or an optax.MultiSteps. Received: inner='adam'",
        ),
        (
            lambda: lso.dynamic_loss_scale(optax.adam(0.1), dynamic_growth_steps=0),
            ValueError,
            r"`dynamic_growth_steps` must be an integer >= 1. Received: dynamic_growth_steps=0",
        ),
        (
            lambda: lso.dynamic_loss_scale(optax.adam(0.1), axis_name=("model", 2)),
            ValueError,
            r"^`axis_name` must be a mapped axis name \(a non-empty string\) or a non-empty "
            r"tuple of them, or None. Received: axis_name=\('model', 2\)$",
        ),
        (
            lambda: tx.update(grads, {"scale": 1.0}, params),
            TypeError,
            r"`state` must be the DynamicLossScaleState returned by this transformation's "
            r"`init` or `update`. Received: state of type dict",
        ),
        (
            lambda: lso.dynamic_loss_scale(optax.adam(0.1)).update(grads, state, params),
            ValueError,
            r"`state` was made by a dynamic_loss_scale with other settings. Expected: "
            r"LossScalePolicy\(.*telemetry=False, .*\). Received: LossScalePolicy\(.*telemetry=True",
        ),
        (
            lambda: tx.update({"w": jnp.ones(2, jnp.int32), "b": jnp.ones(3)}, state, params),
            TypeError,
            r"`updates` must be floating-point gradients \(float16, bfloat16, float32, "
            r"float64 arrays\). Received: \['w'\]: int32",
        ),
        (
            lambda: tx.update({"w": jnp.ones(2), "b": True}, state, params),
            TypeError,
            r"Received: \['b'\]: bool",
        ),
        (
            lambda: tx.update({"w": jnp.ones(2)}, state, {"w": jnp.ones(2)}),
            ValueError,
            r"`updates` must hold one gradient per parameter the state was made for "
            r"\(2: \['b', 'w'\]\). Received: 1 gradients",
        ),
        (
            lambda: tx.update({"w": jnp.ones(2), "c": jnp.ones(3)}, state, params),
            ValueError,
            r"`updates` must have the tree structure of `params`. Received: "
            r"updates=PyTreeDef\(\{'c': \*, 'w': \*\}\), params=PyTreeDef\(\{'b': \*, 'w': \*\}\)",
        ),
        (
            lambda: tx.update({"w": jnp.ones(2), "b": jnp.ones(4)}, state, params),
            ValueError,
            r"The gradient at \['b'\] must have its parameter's shape \(3,\) \(after any "
            r"leading per-example axes\). Received: shape \(4,\)",
        ),
    ]
    drifting = lso.dynamic_loss_scale(
        optax.GradientTransformation(
            lambda params: {"t": jnp.zeros((), jnp.int32)},
            lambda updates, state, params=None: (updates, {"t": state["t"] + 0.5}),
        )
    )
    cases.append(
        (
            lambda: drifting.update(grads, drifting.init(params), params),
            ValueError,
            r"The inner transformation's `update` returned a state of another structure, dtype "
            r"or shape than it was given, which a skipped step cannot stand in for. A "
            r"transformation whose state changes on its first update \(optax.monitor\) can "
            r"follow dynamic_loss_scale in an optax.chain instead; one whose float32 "
            r"hyperparameters widen a lower-precision state \(optax.inject_hyperparams over "
            r"bfloat16 or float16 parameters\) takes hyperparam_dtype=<that dtype>. "
            r"Received: \[\"\['t'\]: int32\[\] -> float32\[\]\"\]",
        )
    )
    # optax itself widens Adam's bfloat16 `mu` on the first update here.
    mixed = {"a": jnp.ones(8, jnp.float32), "h": jnp.ones(8, jnp.bfloat16)}
    mixed_grads = {k: jnp.full(8, 0.5, v.dtype) for k, v in mixed.items()}
    for dtype, message in [
        (
            None,
            r"hyperparam_dtype=<that dtype>. Received: \[\"\.inner_state\[0\]\.mu\['h'\]: "
            r"bfloat16\[8\] -> float32\[8\]",
        ),
        (jnp.bfloat16, None),
    ]:
        injected = lso.dynamic_loss_scale(
            optax.inject_hyperparams(optax.adam, hyperparam_dtype=dtype)(learning_rate=1e-3)
        )
        call = lambda t=injected: t.update(mixed_grads, t.init(mixed), mixed)  # noqa: E731
        if message is None:
            call()
        else:
            cases.append((call, ValueError, message))
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_docstring_example():
    result = doctest.testmod(transform_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_import_lossscale_imports_no_optax_and_lossscale_optax_does():
    code = (
        "import sys, lossscale, lossscale.pytree, lossscale.saving; "
        "before = sorted(m for m in ('jax', 'optax', 'lossscale.optax') if m in sys.modules); "
        "import lossscale.optax; "
        "after = sorted(m for m in ('jax', 'optax', 'lossscale.optax') if m in sys.modules); "
        "print(before, after)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] ['jax', 'lossscale.optax', 'optax']"
    # Without optax, the import says what is missing and how to install it.
    code = "import sys; sys.modules['optax'] = None; import lossscale.optax"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1
    assert "ImportError: lossscale.optax needs JAX and optax (" in out.stderr
    assert "pip install jax optax" in out.stderr


# --- diagnostics: the float16 range and the overflow window in the state --------


def _diagnosed_run(jit, steps=7):
    """A `dynamic_loss_scale` with every diagnostic on; returns the state and the gradients."""
    rng = np.random.default_rng(8)
    params = {"big": jnp.zeros((300, 250)), "mid": jnp.zeros(4097), "small": jnp.zeros(7)}
    tx = lso.dynamic_loss_scale(
        optax.adam(1e-3), 2.0**12, telemetry=True, diagnostics_every=3, history_length=4
    )
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    sent = []
    for k in range(steps):
        grads = {
            name: (rng.uniform(-1, 1, p.shape) * 10.0 ** rng.uniform(-9, 1, p.shape)).astype(
                np.float32
            )
            * float(lso.loss_scale(state))
            for name, p in params.items()
        }
        if k == 4:
            grads["mid"][4096] = np.nan
        loss = jnp.float32(np.inf if k == 5 else 1.0)
        if k == 5:
            grads["small"][:] = np.inf
        sent.append(grads)
        _, state = update(jax.tree_util.tree_map(jnp.asarray, grads), state, params, value=loss)
    return state, sent


def test_the_float16_range_and_window_under_jit_equal_the_eager_ones():
    jitted, sent = _diagnosed_run(jit=True)
    eager, _ = _diagnosed_run(jit=False)
    summary = lso.summary(jitted)
    assert summary == lso.summary(eager)
    assert summary["float16_range_step"] == 6
    assert summary["overflows"] == [
        {"step": 4, "cause": "overflow", "variables": ["mid"], "module": None, "loss_finite": True},
        {
            "step": 5,
            "cause": "nonfinite_loss",
            "variables": ["small"],
            "module": None,
            "loss_finite": False,
        },
    ]
    # The last measured step's scaled gradients, counted in float64.
    for name, got in summary["float16_range"].items():
        a = np.abs(sent[6][name].astype(np.float64))
        assert got["zero"] == pytest.approx(np.mean(a == 0), abs=1e-7)
        assert got["subnormal"] == pytest.approx(np.mean((a > 0) & (a < 2.0**-14)), rel=1e-6)
        assert got["near_max"] == pytest.approx(np.mean(a >= 65504.0 / 2), abs=1e-7)
        assert got["max_abs"] == np.float32(a.max())


def test_a_step_that_is_not_due_measures_nothing():
    # Under jit the measurement sits in a `lax.cond`: the compiled step holds
    # one conditional, whose untaken branch keeps the last measurement.
    params = {"w": jnp.zeros(5000)}
    tx = lso.dynamic_loss_scale(optax.sgd(0.1), diagnostics_every=2)
    state = tx.init(params)
    text = jax.jit(tx.update).lower({"w": jnp.ones(5000)}, state, params).as_text()
    assert text.count("stablehlo.case") + text.count("mhlo.case") >= 1
    for k in range(3):
        _, state = jax.jit(tx.update)({"w": jnp.full(5000, 2.0**16 * (k + 1))}, state, params)
    summary = lso.summary(state)
    assert summary["float16_range_step"] == 2
    assert summary["float16_range"]["w"]["near_max"] == 1.0  # 3 * 2^16 >= 65504 / 2


def test_diagnostics_under_jit_equal_eager_and_a_float64_count():
    # What docs/diagnosing.md says of optax: the float16 range and the
    # overflow window in the state, the same under `jit`, the loss's flag
    # from `update(..., value=loss)`.
    tx = lso.dynamic_loss_scale(
        optax.sgd(0.1), initial_scale=2.0**10, diagnostics_every=2, telemetry=True
    )
    params = {"a": jnp.zeros((300, 250)), "b": jnp.zeros(7)}

    def run(update):
        rng = np.random.default_rng(0)
        state, grads_at = tx.init(params), {}
        for k in range(4):
            grads = {
                "a": rng.standard_normal((300, 250)).astype(np.float32) * 1e-2,
                "b": np.full(7, np.inf if k == 3 else 1.0, np.float32),
            }
            loss = np.float32(np.nan if k == 1 else 1.0)
            if k == 1:  # a NaN loss: every gradient NaN
                grads = {n: g * np.nan for n, g in grads.items()}
            grads_at[k] = grads
            _, state = update(jax.tree.map(jnp.asarray, grads), state, params, value=loss)
        return lso.summary(state), grads_at

    eager, grads_at = run(tx.update)
    jitted, _ = run(jax.jit(tx.update))
    assert jitted == eager
    assert eager["overflows"] == [
        {
            "step": 1,
            "cause": "nonfinite_loss",
            "variables": ["a", "b"],
            "module": None,
            "loss_finite": False,
        },
        {"step": 3, "cause": "overflow", "variables": ["b"], "module": None, "loss_finite": True},
    ]
    assert eager["float16_range_step"] == 2
    a = np.abs(grads_at[2]["a"].astype(np.float64))
    measured = eager["float16_range"]["a"]
    assert measured["zero"] == pytest.approx(np.count_nonzero(a == 0) / a.size, abs=1e-7)
    subnormal = np.count_nonzero((a > 0) & (a < 2.0**-14)) / a.size
    assert subnormal > 0 and measured["subnormal"] == pytest.approx(subnormal, rel=1e-6)
    assert measured["near_max"] == 0.0 and measured["max_abs"] == np.float32(a.max())


@pytest.mark.parametrize("jit", [False, True])
def test_an_empty_parameter_keeps_its_entry_and_the_others_are_measured_in_place(jit):
    # The range fields are vectors with an entry per parameter: an empty
    # parameter has nothing to measure, and the entries after it stay theirs.
    params = {"a": jnp.zeros(300), "b": jnp.zeros((0, 4)), "c": jnp.zeros(5000), "d": jnp.zeros(3)}
    tx = lso.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**10, diagnostics_every=1)
    state = tx.init(params)
    rng = np.random.default_rng(4)
    grads = {
        "a": rng.standard_normal(300).astype(np.float32) * 1e-6,
        "b": np.zeros((0, 4), np.float32),
        "c": rng.standard_normal(5000).astype(np.float32) * 3e4,
        "d": np.asarray([0.0, 1.0, np.inf], np.float32),
    }
    update = jax.jit(tx.update) if jit else tx.update
    _, state = update(jax.tree.map(jnp.asarray, grads), state, params)
    measured = lso.summary(state)["float16_range"]
    assert measured["b"] == {"zero": 0.0, "subnormal": 0.0, "near_max": 0.0, "max_abs": 0.0}
    for name in "acd":
        a = np.abs(grads[name].astype(np.float64))
        assert measured[name] == {
            "zero": pytest.approx(np.count_nonzero(a == 0) / a.size, rel=1e-6),
            "subnormal": pytest.approx(
                np.count_nonzero((a > 0) & (a < 2.0**-14)) / a.size, rel=1e-6
            ),
            "near_max": pytest.approx(np.count_nonzero(a >= 65504 / 2) / a.size, rel=1e-6),
            "max_abs": np.float32(a.max()),
        }, name


def test_diagnostics_reserve_no_copy_of_the_gradients_in_the_jitted_update():
    """XLA reserves the measurement branch's memory on every step, taken or not.

    Compiled only, on abstract arrays of GPT-2's shapes with two blocks
    (53M parameters): with `diagnostics_every` the update reserves at most
    the measurement's packed elements (`backends/jax/float16_range.py`)
    more, where packing every gradient reserved a float32 copy of them all
    (204 MiB; GPT-2 small's: 475 MiB).
    """
    from lossscale.backends.jax import float16_range
    from tests.backends.jax.test_float16_range import _gpt2

    params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in _gpt2(2)]

    def reserved(every):
        tx = lso.dynamic_loss_scale(optax.adam(1e-3), diagnostics_every=every)
        state = jax.eval_shape(tx.init, params)
        compiled = jax.jit(tx.update).lower(params, state, params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert reserved(100) - reserved(None) <= 4 * float16_range.PACK_CAPACITY * 1.2


def test_each_skip_s_cause_with_the_loss_given_as_value():
    tx = lso.dynamic_loss_scale(optax.adam(1e-3), 2.0**5, telemetry=True)
    params = {"b": jnp.zeros(300), "w": jnp.ones((64, 33))}
    state = tx.init(params)
    step = jax.jit(tx.update)
    rng = np.random.default_rng(6)

    def grads(bad):
        out = {k: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for k, p in params.items()}
        if bad:
            flat = out["w"].reshape(-1)
            out["w"] = flat.at[int(rng.integers(flat.size))].set(jnp.nan).reshape(64, 33)
        return out

    _, state = step(grads(True), state, params, value=jnp.asarray(jnp.nan))  # NaN data
    for _ in range(6):  # 16 -> 1 in four back-offs, then the same leaf again: persistent
        _, state = step(grads(True), state, params, value=jnp.asarray(0.5))
    summary = lso.summary(state)
    causes = [o["cause"] for o in summary["overflows"]]
    assert causes == ["nonfinite_loss"] + ["overflow"] * 4 + ["persistent"] * 2
    assert summary["persistent_step"] == 5 and summary["overflows"][-1]["variables"] == ["w"]
    assert [o["loss_finite"] for o in summary["overflows"]] == [False] + [True] * 6
