"""`lossscale.optax.adapter.OptaxAdapter`: optax transformations driven by lossscale and `LossScaleOptimizer`.

Wrapped in a `LossScaleOptimizer` with injected inf/NaN gradients, the
parameters and every state leaf follow, bit for bit, the transformation
run directly (`init`, `update`, `apply_updates`) on the unscaled gradients
of the steps that were not skipped; `jax.jit(stateless_apply)` follows the
same trajectory and compiles once. Scales are powers of two, so unscaling
is exact.
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from lossscale.optax import OptaxAdapter, adapter

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")

SHAPES = [(4, 3), (5,)]
STEPS = 10
BAD_STEPS = {0: np.inf, 4: np.nan, 7: -np.inf}
INITIAL_SCALE, GROWTH_STEPS = 16.0, 2

TRANSFORMATIONS = {
    "adam": lambda: optax.adam(0.01),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    # Gradients are ~N(0, 2): their global norm (~7) is clipped to 1.
    "clip_then_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.01)),
    "injected_adamw": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=0.01, weight_decay=0.1
    ),
}


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in SHAPES]


def make_grads(seed=1):
    """Unscaled gradients per step; `None` where the step overflows."""
    rng = np.random.default_rng(seed)
    return [
        None
        if step in BAD_STEPS
        else [jnp.asarray(2 * rng.normal(size=s).astype(np.float32)) for s in SHAPES]
        for step in range(STEPS)
    ]


def scaled(grads, step, scale):
    if grads is None:
        return [jnp.ones(SHAPES[0]), jnp.ones(SHAPES[1]).at[2].set(BAD_STEPS[step])]
    return [g * scale for g in grads]


def wrapped(name):
    return ls.LossScaleOptimizer(
        OptaxAdapter(TRANSFORMATIONS[name]()),
        initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS,
    )


def reference(name, params, steps=range(STEPS)):
    """The transformation run directly; returns `(params, state)` after each step."""
    tx = TRANSFORMATIONS[name]()
    state = tx.init(params)
    grads = make_grads()
    out = []
    for step in steps:
        if grads[step] is not None:
            updates, state = tx.update(grads[step], state, params)
            params = optax.apply_updates(params, updates)
        out.append((params, state))
    return out


def assert_equal_trees(ours, theirs):
    ours, theirs = jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def run(opt, variables, steps):
    grads = make_grads()
    for step in steps:
        opt.apply(scaled(grads[step], step, opt.scale_loss(1.0)), variables)


# --- the trajectory -----------------------------------------------------------
@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_trajectory_equals_optax_without_skipped_steps(name):
    variables = [ls.Variable(p, name=f"w{i}") for i, p in enumerate(make_params())]
    opt = wrapped(name)
    inner = opt.inner_optimizer
    for step, (params, state) in enumerate(reference(name, make_params())):
        run(opt, variables, [step])
        assert_equal_trees([v.value for v in variables], params)
        assert_equal_trees([v.value for v in inner.variables[1:]], state)
    assert int(opt.iterations) == STEPS - len(BAD_STEPS)
    # 16, overflow -> 8, two finite -> 16, overflow -> 8, ... and two finite steps at the end.
    assert float(opt.dynamic_scale) == 16.0


@pytest.mark.parametrize("name", ["adam", "clip_then_adam", "injected_adamw"])
def test_jit_stateless_apply_equals_eager_and_traces_once(name):
    opt = wrapped(name)
    params = make_params()
    opt.build(params)
    traces = []

    def step(optimizer_values, grads, params):
        traces.append(1)
        return opt.stateless_apply(optimizer_values, grads, params)

    jitted = jax.jit(step)
    values = [v.value for v in opt.variables]
    before = [np.asarray(v) for v in values]
    grads = make_grads()
    scale_index = [v.path for v in opt.variables].index("loss_scale_optimizer/dynamic_scale")
    expected = reference(name, make_params())
    for step_index in range(STEPS):
        g = scaled(grads[step_index], step_index, values[scale_index])
        params, values = jitted(values, g, params)
        ref_params, ref_state = expected[step_index]
        for a, b in zip(params + values[3:], jax.tree_util.tree_leaves((ref_params, ref_state))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert len(traces) == 1
    assert int(values[2]) == STEPS - len(BAD_STEPS) and float(values[scale_index]) == 16.0
    for variable, value in zip(opt.variables, before):  # stateless: nothing written
        np.testing.assert_array_equal(variable.numpy(), value)


def test_stateless_apply_of_the_adapter_itself():
    opt = OptaxAdapter(optax.adam(0.01))
    params = make_params()
    opt.build(params)
    grads = make_grads()[1]
    new_params, new_values = jax.jit(opt.stateless_apply)(
        [v.value for v in opt.variables], grads, params
    )
    ((ref_params, ref_state),) = reference("adam", make_params(), [1])
    # Compiled, XLA may fuse the arithmetic differently: equal to rounding.
    for a, b in zip(
        new_params + new_values[1:], jax.tree_util.tree_leaves((ref_params, ref_state))
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert int(new_values[0]) == 1 and int(opt.iterations) == 0


def test_variables_are_the_state_leaves_named_by_their_paths():
    opt = wrapped("clip_then_adam")
    opt.build(make_params())
    assert [v.path for v in opt.inner_optimizer.variables] == [
        "optax_optimizer/iteration",
        "optax_optimizer/1/0/count",
        "optax_optimizer/1/0/mu/0",
        "optax_optimizer/1/0/mu/1",
        "optax_optimizer/1/0/nu/0",
        "optax_optimizer/1/0/nu/1",
    ]
    assert [v.dtype for v in opt.inner_optimizer.variables[1:3]] == ["int32", "float32"]


def test_colliding_short_names_fall_back_to_full_key_strings():
    tx = optax.GradientTransformation(
        lambda params: {"a/b": jnp.zeros(()), "a": {"b": jnp.ones(())}},
        lambda updates, state, params=None: (updates, state),
    )
    opt = OptaxAdapter(tx, name="custom")
    opt.build(make_params())
    assert [v.path for v in opt.variables] == [
        "custom/iteration",
        "custom/['a']['b']",
        "custom/['a/b']",
    ]


# --- learning rate ------------------------------------------------------------
def test_injected_learning_rate_reads_and_sets_the_state_leaf():
    opt = wrapped("injected_adamw")
    variables = [ls.Variable(p) for p in make_params()]
    run(opt, variables, [1])
    assert float(opt.learning_rate) == pytest.approx(0.01)
    opt.learning_rate = 0.5
    assert float(opt.inner_optimizer.learning_rate) == 0.5
    # The next step runs with the new rate, as optax's own state edit would.
    tx = TRANSFORMATIONS["injected_adamw"]()
    params = make_params()
    state = tx.init(params)
    grads = make_grads()
    updates, state = tx.update(grads[1], state, params)
    params = optax.apply_updates(params, updates)
    state.hyperparams["learning_rate"] = jnp.asarray(0.5)
    updates, state = tx.update(grads[2], state, params)
    params = optax.apply_updates(params, updates)
    run(opt, variables, [2])
    assert_equal_trees([v.value for v in variables], params)


def test_learning_rate_errors():
    plain = OptaxAdapter(optax.adam(0.01))
    with pytest.raises(
        AttributeError,
        match=r"created when the optimizer is built\. Call "
        r"`optimizer\.build\(trainable_variables\)`",
    ):
        _ = plain.learning_rate
    plain.build(make_params())
    message = (
        r"keeps its learning rate inside a closure.*optax\.inject_hyperparams\(optax\."
        r"adam\)\(learning_rate=1e-3\)"
    )
    with pytest.raises(AttributeError, match=message):
        _ = plain.learning_rate
    with pytest.raises(AttributeError, match=message):
        ls.LossScaleOptimizer(plain).learning_rate = 0.1
    assert getattr(plain, "learning_rate", None) is None
    injected = OptaxAdapter(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    injected.build(make_params())
    with pytest.raises(TypeError, match="only be set to a number.*Received: learning_rate="):
        injected.learning_rate = optax.constant_schedule(0.1)
    with pytest.raises(
        ValueError,
        match=r"`learning_rate` must be a finite number >= 0\. "
        r"Received: learning_rate=-0\.5",
    ):
        injected.learning_rate = -0.5
    assert float(injected.learning_rate) == pytest.approx(0.1)
    twice = OptaxAdapter(
        optax.chain(
            optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            optax.inject_hyperparams(optax.sgd)(learning_rate=0.2),
        )
    )
    with pytest.raises(
        ValueError,
        match=r"injects several learning rates \(\[\"\[0\]\.hyperpa"
        r"rams\['learning_rate'\]\", \"\[1\]\.hyperparams",
    ):
        twice.build(make_params())
    assert not twice.built and len(twice.variables) == 1


# --- state ---------------------------------------------------------------------
@pytest.mark.parametrize("how", ["own_variables", "state_dict", "set_weights"])
@pytest.mark.parametrize("name", ["adam", "injected_adamw"])
def test_saved_state_resumes_the_trajectory(how, name):
    variables = [ls.Variable(p, name=f"w{i}") for i, p in enumerate(make_params())]
    opt = wrapped(name)
    run(opt, variables, range(6))
    twin_variables = [ls.Variable(v.value, name=v.name) for v in variables]
    twin = wrapped(name)
    twin.build(twin_variables)
    if how == "own_variables":
        store = {}
        opt.save_own_variables(store)
        twin.load_own_variables(store)
    elif how == "state_dict":
        twin.load_state_dict(opt.state_dict())
    else:
        twin.set_weights([v.numpy() for v in opt.variables])
    run(opt, variables, range(6, STEPS))
    run(twin, twin_variables, range(6, STEPS))
    assert_equal_trees([v.value for v in twin_variables], [v.value for v in variables])
    assert_equal_trees([v.value for v in twin.variables], [v.value for v in opt.variables])


# --- errors ----------------------------------------------------------------------
def test_construction_errors():
    with pytest.raises(
        ValueError,
        match=r"`transformation` must be an optax\."
        r"GradientTransformation.*Received: transformation="
        r"'adam'",
    ):
        OptaxAdapter("adam")
    with pytest.raises(
        ValueError,
        match=r"not recognized by OptaxAdapter: \['clipnorm'\]\. "
        r"Accepted: transformation, name\. .*optax\.chain",
    ):
        OptaxAdapter(optax.adam(0.1), clipnorm=1.0)


def test_build_errors_leave_the_optimizer_unbuilt():
    import torch

    cases = [
        ([np.ones(2, np.float32)], r"works on JAX arrays\. Received: var_list of numpy arrays"),
        ([torch.ones(2)], r"works on JAX arrays\. Received: var_list of torch arrays"),
        (
            [ls.Variable(jnp.ones(2), name="scale", overwrite_with_gradient=True)],
            r"cannot hold overwrite-with-gradient variables.*Received: \['scale'\]",
        ),
    ]
    for var_list, message in cases:
        opt = OptaxAdapter(optax.adam(0.1))
        with pytest.raises(ValueError, match=message):
            opt.build(var_list)
        assert not opt.built and len(opt.variables) == 1


@pytest.mark.parametrize("missing", ["none", "absent"])
def test_every_variable_needs_a_gradient(missing):
    variables = [ls.Variable(p, name=f"w{i}") for i, p in enumerate(make_params())]
    opt = wrapped("adam")
    run(opt, variables, [1])
    before = [v.numpy() for v in variables + opt.variables]
    g = scaled(make_grads()[2], 2, opt.scale_loss(1.0))
    grads, targets = ([g[0], None], variables) if missing == "none" else (g[:1], variables[:1])
    with pytest.raises(
        ValueError,
        match=r"needs a gradient for every variable it was built "
        r"with.*optax\.masked.*Received: no gradient for "
        r"\['w1'\]",
    ):
        opt.apply(grads, targets)
    for variable, value in zip(variables + opt.variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_a_state_of_another_structure_is_refused_before_writing():
    tx = optax.GradientTransformation(
        lambda params: (), lambda updates, state, params=None: (updates, (1.0,))
    )
    variables = [ls.Variable(p) for p in make_params()]
    opt = OptaxAdapter(tx)
    opt.build(variables)
    before = [v.numpy() for v in variables]
    with pytest.raises(
        ValueError, match="returned a state of another structure than its `init` made"
    ):
        opt.apply(make_grads()[1], variables)
    for variable, value in zip(variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)
    assert int(opt.iterations) == 0


def test_unsupported_methods_raise():
    opt = wrapped("adam")
    opt.build(make_params())
    for target in (opt.inner_optimizer, opt):
        with pytest.raises(
            NotImplementedError,
            match="OptaxAdapter cannot be serialized: an optax."
            "GradientTransformation is a pair of functions",
        ):
            target.get_config()
    with pytest.raises(NotImplementedError, match="optax.add_decayed_weights"):
        opt.inner_optimizer.exclude_from_weight_decay(var_names=["bias"])


def test_docstring_example():
    result = doctest.testmod(adapter, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_the_earlier_name_is_the_adapter():
    # `OptaxOptimizer` was the adapter's name until 0.1.x: code written for it runs.
    import lossscale.optax as lso

    assert lso.OptaxOptimizer is lso.OptaxAdapter and "OptaxOptimizer" in lso.__all__


# --- the parameters optax sees ------------------------------------------------
def test_optax_sees_the_list_a_mask_over_the_users_tree_raises_with_a_note():
    import lossscale.pytree

    params = {"w": jnp.ones((64, 32)), "n": jnp.ones(32)}
    for tx in (
        optax.masked(optax.adam(0.1), {"w": True, "n": False}),
        optax.multi_transform(
            {"a": optax.adam(0.1), "z": optax.set_to_zero()}, {"w": "a", "n": "z"}
        ),
    ):
        transform = lossscale.pytree.transform(ls.LossScaleOptimizer(OptaxAdapter(tx)))
        with pytest.raises(ValueError) as raised:
            transform.init(params)
        assert any(
            "OptaxAdapter gives the transformation the parameters as the list it is built "
            "with (2 arrays; from lossscale.pytree.transform, the tree's leaves in "
            "jax.tree_util order)" in note
            for note in raised.value.__notes__
        )


def test_a_mask_over_the_list_equals_optax_masked_over_the_tree():
    import lossscale.pytree

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32), "n": jnp.ones(32)}
    reference = optax.masked(optax.adam(0.01), {"w": True, "n": False})
    ours = optax.masked(optax.adam(0.01), [False, True])  # the leaves: n, then w
    transform = lossscale.pytree.transform(
        ls.LossScaleOptimizer(OptaxAdapter(ours), initial_scale=INITIAL_SCALE)
    )
    state, theirs = transform.init(params), reference.init(params)
    step = transform.apply  # eager, as the reference: XLA fuses a jitted Adam its own way
    expected = params
    for k in range(5):
        grads = jax.tree_util.tree_map(
            lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params
        )
        scale = transform.scale_loss(jnp.float32(1.0), state)
        scaled = {key: g * scale for key, g in grads.items()}
        if k == 2:  # an overflow: skipped, the reference does not step
            scaled["w"] = scaled["w"].at[63, 31].set(jnp.inf)
            params, state = step(scaled, state, params)
            continue
        params, state = step(scaled, state, params)
        updates, theirs = reference.update(grads, theirs, expected)
        expected = optax.apply_updates(expected, updates)
        assert_equal_trees(params, expected)
    assert float(transform.loss_scale(state)) == INITIAL_SCALE / 2


@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_state_leaves_keep_the_dtype_init_gave_them(name):
    # bfloat16 parameters: the wrapper unscales their gradients in float32,
    # which widens a bfloat16 moment in optax's update; the adapter's
    # variables keep init's dtype, so the leaf is rounded back each step.
    rng = np.random.default_rng(3)
    start = jnp.asarray(rng.normal(size=(256, 64)), jnp.bfloat16)
    w = ls.Variable(start, name="w")
    opt = ls.LossScaleOptimizer(OptaxAdapter(TRANSFORMATIONS[name]()), initial_scale=2.0**8)
    tx = TRANSFORMATIONS[name]()
    params, state = [start], tx.init([start])
    for _ in range(4):
        grad = jnp.asarray(rng.normal(size=(256, 64)) * 1e-2, jnp.bfloat16)
        opt.apply([grad * jnp.bfloat16(opt.scale_loss(1.0))], [w])
        unscaled = [grad.astype(jnp.float32) * 2.0**8 / 2.0**8]
        updates, new = tx.update(unscaled, state, params)
        params = optax.apply_updates(params, updates)
        state = jax.tree_util.tree_map(lambda n, o: n.astype(o.dtype), new, state)
        np.testing.assert_array_equal(
            np.asarray(w.value, np.float32), np.asarray(params[0], np.float32)
        )
        for variable, leaf in zip(
            opt.inner_optimizer.variables[1:], jax.tree_util.tree_leaves(state)
        ):
            assert variable.dtype == jnp.dtype(leaf.dtype).name
            np.testing.assert_array_equal(np.asarray(variable.value), np.asarray(leaf))


def test_a_deep_copy_with_its_variables_trains_on_as_the_original():
    """`copy.deepcopy` of (variables, LossScaleOptimizer(optax.adam)): the copy shares the
    (stateless) transformation and copies its state; through a skipped step it steps its
    own variables bit for bit as the original. (`pickle` is optax's to allow: its
    transformations are closures, which pickle refuses.)"""
    import copy

    variables = [ls.Variable(jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)), ls.Variable(jnp.ones(2))]
    opt = ls.LossScaleOptimizer(optax.adam(0.1), initial_scale=16.0)
    opt.scale_loss(1.0)
    opt.apply([jnp.full((2, 3), 2.0), jnp.ones(2)], variables)
    copied_vars, copied = copy.deepcopy((variables, opt))
    steps = [[jnp.full((2, 3), 4.0), jnp.full(2, jnp.inf)], [jnp.full((2, 3), 3.0), jnp.ones(2)]]
    for grads in steps:
        copied.apply(grads, copied_vars)
    for grads in steps:
        opt.apply(grads, variables)
    for a, b in zip(variables + opt.variables, copied_vars + copied.variables):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
    assert int(copied.iterations) == int(opt.iterations) == 2  # the skipped step not counted
