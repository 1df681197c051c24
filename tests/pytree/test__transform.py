"""`lossscale.pytree.transform`: pure init/apply over parameter pytrees, checkpoints, sharding.

`OptimizerState` on its own is in test__state.py, flattening without JAX in
test__flatten.py.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import lossscale as ls
from lossscale import optimizers
from lossscale.optimizers import LossScaleOptimizer
from lossscale.pytree import OptimizerState, Transform, transform

# The tests feed gradients that are already scaled, as `jax.grad` of a scaled
# loss would give them, so the stateful wrapper's reminder does not apply.
pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")
SCALE = 16.0
# Leaf order of the tree below (dict keys sorted): bias, kernel, out/0, out/1.
SHAPES = {"dense/bias": (3,), "dense/kernel": (2, 3), "out/0": (3, 2), "out/1": (2,)}


def nested(arrays):
    """Builds the test tree from four arrays in leaf order."""
    bias, kernel, out0, out1 = arrays
    return {"dense": {"kernel": kernel, "bias": bias}, "out": [out0, out1]}


def leaves(tree):
    return [tree["dense"]["bias"], tree["dense"]["kernel"], tree["out"][0], tree["out"][1]]


def random_arrays(rng, scale=1.0):
    return [(rng.normal(size=s) * scale).astype(np.float32) for s in SHAPES.values()]


def lso(inner=None, growth=2):
    return LossScaleOptimizer(
        inner or optimizers.Adam(0.05), initial_scale=SCALE, dynamic_growth_steps=growth
    )


def gradient_steps(rng, steps):
    out = []
    for step in range(steps):
        grads = random_arrays(rng, SCALE)
        if step in (2, 5):
            grads[step % 4].flat[0] = np.inf if step == 2 else np.nan
        out.append(grads)
    return out


def test_round_trip_matches_stateful_apply(backend, rng):
    """Nested dict in, same tree out, equal to stateful `apply` on the flat leaves."""
    init, steps = random_arrays(rng), gradient_steps(rng, 8)
    tx = transform(lso())
    params = nested([backend.array(x) for x in init])
    state = tx.init(params)
    flat = [ls.Variable(backend.array(x)) for x in init]
    reference = lso()
    for grads in steps:
        params, state = tx.apply(nested([backend.array(g) for g in grads]), state, params)
        reference.apply([backend.array(g) for g in grads], flat)
    assert set(params) == {"dense", "out"} and set(params["dense"]) == {"kernel", "bias"}
    assert isinstance(params["out"], list) and len(params["out"]) == 2
    for got, v in zip(leaves(params), flat):
        assert type(got) is type(v.value)
        np.testing.assert_allclose(backend.numpy(got), v.numpy(), rtol=1e-6, atol=1e-7)
    for name, v in zip(tx.names(params), reference.variables):
        np.testing.assert_allclose(backend.numpy(state[name]), v.numpy(), rtol=1e-6, atol=1e-7)
    assert float(backend.numpy(tx.loss_scale(state))) == float(reference.dynamic_scale)
    assert int(backend.numpy(state["adam/iteration"])) == 6
    # The transform's optimizer never moved: apply is pure.
    assert int(tx.optimizer.iterations.numpy()) == 0


def test_state_names_follow_the_tree(backend):
    params = nested([backend.array(np.zeros(s)) for s in SHAPES.values()])
    tx = transform(lso())
    state = tx.init(params)
    slots = [
        f"adam/{path.replace('/', '_')}_{slot}"
        for path in SHAPES
        for slot in ("momentum", "velocity")
    ]
    assert (
        tx.names(params)
        == [
            "loss_scale_optimizer/step_counter",
            "loss_scale_optimizer/dynamic_scale",
            "adam/iteration",
            "adam/learning_rate",
        ]
        + slots
    )
    assert list(state) == sorted(tx.names(params)) and len(state) == len(tx.names(params))
    assert float(backend.numpy(state["loss_scale_optimizer/dynamic_scale"])) == SCALE
    assert "'adam/dense_kernel_momentum': float32[2, 3]" in repr(state)


def test_scale_loss(backend):
    params = {"w": backend.array(np.ones(2))}
    tx = transform(lso())
    state = tx.init(params)
    assert float(backend.numpy(tx.scale_loss(backend.array(np.float32(0.5)), state))) == SCALE / 2
    state = state.replace(**{"loss_scale_optimizer/dynamic_scale": backend.array(np.float32(4.0))})
    assert float(backend.numpy(tx.scale_loss(backend.array(np.float32(0.5)), state))) == 2.0
    plain = transform(optimizers.SGD(0.1, loss_scale_factor=8.0))
    plain_state = plain.init(params)
    assert (
        float(backend.numpy(plain.scale_loss(backend.array(np.float32(0.5)), plain_state))) == 4.0
    )
    with pytest.raises(ValueError, match="`loss_scale` needs a transform of a LossScaleOptimizer"):
        plain.loss_scale(plain_state)


def test_summary_and_check_read_the_state():
    import jax.numpy as jnp

    from lossscale.mixed_precision import LossScaleError

    opt = LossScaleOptimizer(optimizers.SGD(0.1), initial_scale=SCALE, max_consecutive_skips=2)
    tx = transform(opt)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    step = tx.jit(donate=False)
    for _ in range(2):
        params, state = step({"w": jnp.full(2, jnp.inf)}, state, params)
        tx.check(state)
    summary = tx.summary(state)
    assert summary["dynamic_scale"] == SCALE / 4 and summary["step_counter"] == 0
    params, failed = step({"w": jnp.full(2, jnp.nan)}, state, params)
    with pytest.raises(LossScaleError):
        tx.check(failed)
    tx.check(state)  # the earlier state is still fine: nothing was mutated
    plain = transform(optimizers.SGD(0.1))
    plain_state = plain.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="`check` needs a transform of a LossScaleOptimizer"):
        plain.check(plain_state)
    with pytest.raises(
        ValueError, match=r"`summary` needs a state of a parameter tree this transform has seen"
    ):
        transform(lso()).summary(state)
    with pytest.raises(TypeError, match="`state` must be the OptimizerState returned by"):
        tx.summary(dict(state))


def test_jit_checkpoint_round_trip_and_no_retrace(rng):
    """20 jitted steps, interrupted by a save/restore through NumPy, equal an uninterrupted run."""
    import jax
    import jax.numpy as jnp

    init, steps = random_arrays(rng), gradient_steps(rng, 20)
    tx = transform(lso())
    traces = []

    def counted(grads, state, params):
        traces.append(1)
        return tx.apply(grads, state, params)

    step = jax.jit(lambda p, s, g: counted(g, s, p), donate_argnums=(0, 1))
    params = nested([jnp.asarray(x) for x in init])
    state = tx.init(params)
    for grads in steps[:10]:
        params, state = step(params, state, nested([jnp.asarray(g) for g in grads]))
    saved = {name: np.asarray(x) for name, x in state.items()}
    saved_params = jax.tree_util.tree_map(np.asarray, params)
    # Restore: a state rebuilt from a plain dict (any key order) fits the compiled step.
    state = OptimizerState({name: jnp.asarray(saved[name]) for name in reversed(list(saved))})
    params = jax.tree_util.tree_map(jnp.asarray, saved_params)
    for grads in steps[10:]:
        params, state = step(params, state, nested([jnp.asarray(g) for g in grads]))
    assert len(traces) == 1

    uninterrupted = transform(lso())
    p = nested([jnp.asarray(x) for x in init])
    s = uninterrupted.init(p)
    for grads in steps:
        p, s = uninterrupted.apply(nested([jnp.asarray(g) for g in grads]), s, p)
    for a, b in zip(leaves(params), leaves(p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(s)
    for name in s:
        np.testing.assert_allclose(
            np.asarray(state[name]), np.asarray(s[name]), rtol=1e-6, atol=1e-7
        )


def full_size_copies(hlo_text):
    """Lines of compiled HLO that copy a non-scalar array (a buffer not updated in place)."""
    return [
        line
        for line in hlo_text.splitlines()
        if re.search(r"= [a-z0-9]+\[\d+(,\d+)*\]\S* copy\(", line)
    ]


def test_tx_jit_donates_and_updates_in_place(rng):
    import jax
    import jax.numpy as jnp

    init, steps = random_arrays(rng), gradient_steps(rng, 4)
    tx = transform(lso())
    params = nested([jnp.asarray(x) for x in init])
    state = tx.init(params)
    step = tx.jit()
    # The first step donates (deletes) `state`'s arrays: the plain run starts from copies.
    plain_params, plain_state = jax.tree_util.tree_map(jnp.copy, (params, state))
    for grads in steps:
        grads = nested([jnp.asarray(g) for g in grads])
        plain_params, plain_state = tx.apply(grads, plain_state, plain_params)
        old = jax.tree_util.tree_leaves([params, state])
        params, state = step(grads, state, params)
        assert all(x.is_deleted() for x in old)
    for a, b in zip(
        jax.tree_util.tree_leaves([params, state]),
        jax.tree_util.tree_leaves([plain_params, plain_state]),
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    kept = tx.jit(donate=False)
    args = (nested([jnp.asarray(g) for g in steps[0]]), state, params)
    kept(*args)
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(args))
    with pytest.raises(ValueError, match=r"`donate` must be a boolean. Received: donate=1"):
        tx.jit(donate=1)
    # Inputs donated in output order: XLA writes every parameter and slot in place.
    compiled = (
        jax.jit(lambda p, s, g: tx.apply(g, s, p), donate_argnums=(0, 1))
        .lower(params, state, args[0])
        .compile()
        .as_text()
    )
    assert full_size_copies(compiled) == []


def test_half_precision_gradients_on_float32_params():
    """float16/bfloat16 gradients give exactly the float32 result for the same values."""
    import jax
    import jax.numpy as jnp

    tx = transform(lso(growth=100))
    params = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
    state = tx.init(params)
    # Tiny true gradients: scaled by 16 they are representable in half precision.
    true = {"w": jnp.asarray([[3e-6, -1e-5], [2e-4, 7e-7]]), "b": jnp.asarray([-2e-6, 5e-3])}
    step = jax.jit(tx.apply)
    for dtype in ("float16", "bfloat16"):
        grads = jax.tree_util.tree_map(lambda g, dtype=dtype: (g * SCALE).astype(dtype), true)
        as_float32 = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
        new_params, new_state = step(grads, state, params)
        expected_params, expected_state = step(as_float32, state, params)
        for a, b in zip(
            jax.tree_util.tree_leaves([new_params, new_state]),
            jax.tree_util.tree_leaves([expected_params, expected_state]),
        ):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert int(new_state["adam/iteration"]) == 1
        overflow = {"w": grads["w"].at[0, 0].set(jnp.inf), "b": grads["b"]}
        skipped_params, skipped_state = step(overflow, state, params)
        assert int(skipped_state["adam/iteration"]) == 0
        assert float(tx.loss_scale(skipped_state)) == SCALE / 2


def test_vmap_over_an_ensemble(rng):
    """Each member of a vmapped ensemble takes its own skip/scale decision."""
    import jax
    import jax.numpy as jnp

    members = [random_arrays(rng) for _ in range(2)]
    grads = [random_arrays(rng, SCALE) for _ in range(2)]
    grads[1][2].flat[0] = np.inf
    tx = transform(lso())
    stacked = nested([jnp.stack([jnp.asarray(m[i]) for m in members]) for i in range(4)])
    stacked_grads = nested([jnp.stack([jnp.asarray(g[i]) for g in grads]) for i in range(4)])
    state = jax.vmap(tx.init)(stacked)
    new_params, new_state = jax.jit(jax.vmap(tx.apply))(stacked_grads, state, stacked)
    np.testing.assert_array_equal(np.asarray(new_state["adam/iteration"]), [1, 0])
    np.testing.assert_array_equal(
        np.asarray(new_state["loss_scale_optimizer/dynamic_scale"]), [SCALE, SCALE / 2]
    )
    for k in range(2):
        single = transform(lso())
        p = nested([jnp.asarray(x) for x in members[k]])
        p, _ = single.apply(nested([jnp.asarray(g) for g in grads[k]]), single.init(p), p)
        for a, b in zip(leaves(new_params), leaves(p)):
            np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_stateful_optimizers_values_become_a_state():
    """The documented handoff: a built optimizer is refused, its values carry over."""
    import jax.numpy as jnp

    opt = lso()
    variables = [ls.Variable(jnp.ones(3)), ls.Variable(jnp.zeros(2))]
    opt.apply([jnp.full(3, SCALE), jnp.full(2, SCALE)], variables)
    with pytest.raises(
        ValueError,
        match=r"`optimizer` must not be built: a transform builds its own copy for each "
        r"parameter tree.*OptimizerState\(dict\(zip\(tx.names\(params\), "
        r"\[v.value for v in optimizer.variables\]\)\)\). Received: optimizer=<LossScaleOptimizer",
    ):
        transform(opt)
    tx = transform(lso())
    params = [v.value for v in variables]
    state = OptimizerState(dict(zip(tx.names(params), [v.value for v in opt.variables])))
    assert int(state["adam/iteration"]) == 1
    params, state = tx.apply([jnp.full(3, SCALE), jnp.full(2, SCALE)], state, params)
    opt.apply([jnp.full(3, SCALE), jnp.full(2, SCALE)], variables)
    for a, v in zip(params, variables):
        np.testing.assert_array_equal(np.asarray(a), v.numpy())
    for name, v in zip(tx.names(params), opt.variables):
        np.testing.assert_array_equal(np.asarray(state[name]), v.numpy())


def test_errors(rng):
    import jax.numpy as jnp
    import torch

    from lossscale.torch import TorchAdapter

    with pytest.raises(
        ValueError,
        match=r"`optimizer` must be a lossscale.optimizers.Optimizer "
        r"instance. Received: optimizer='adam'",
    ):
        transform("adam")
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(
        ValueError,
        match=r"`optimizer` keeps its state in a native optimizer, which updates tensors in "
        r"place and cannot run as pure functions.*Received: optimizer=<LossScaleOptimizer",
    ):
        transform(LossScaleOptimizer(TorchAdapter(torch.optim.SGD([w], lr=0.1))))
    tx = transform(lso())
    params = {"a": jnp.ones(2), "b": [jnp.ones(3)]}
    with pytest.raises(
        TypeError,
        match=r"`state` must be the OptimizerState returned by `init` or `apply`. "
        r"Received: state of type NoneType",
    ):
        tx.apply(params, None, params)
    with pytest.raises(TypeError, match=r"Received: state of type NoneType"):
        tx.loss_scale(None)
    with pytest.raises(
        ValueError, match=r"`params` must hold at least one array. Received: params=\{\}"
    ):
        tx.init({})
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"`grads` must have the structure of `params`"):
        tx.apply({"a": jnp.ones(2), "b": jnp.ones(3)}, state, params)
    with pytest.raises(
        TypeError,
        match=r"`state` must be the OptimizerState returned by `init` "
        r"or `apply`. Received: state of type dict",
    ):
        tx.apply(params, dict(state), params)
    partial = OptimizerState({k: v for k, v in state.items() if k != "adam/iteration"})
    with pytest.raises(
        ValueError,
        match=r"`state` does not match the optimizer's variables for these `params`. "
        r"Missing: \['adam/iteration'\]. Unexpected: \[\]",
    ):
        tx.apply(params, partial, params)
    # A state of another tree: its slots are named after that tree's paths.
    other = {"a": jnp.ones(4), "b": [jnp.ones(3)]}
    with (
        pytest.raises(
            ValueError,
            match=r"`state` does not match the optimizer's variables for these `params`. "
            r"Missing: \[\]. Unexpected: \[\]",
        )
        if False
        else pytest.raises(ValueError, match=r"must have shape \(4,\)")
    ):
        tx.apply(other, state, other)


def test_init_is_pure_and_serves_any_tree(rng):
    """`init` traces (jit, eval_shape) and one transform trains two different models."""
    import jax
    import jax.numpy as jnp

    tx = transform(lso())
    first = nested([jnp.asarray(x) for x in random_arrays(rng)])
    second = {"w": jnp.asarray(rng.normal(size=(7,)).astype(np.float32))}
    abstract = jax.eval_shape(tx.init, first)  # the first call may be abstract
    traced = jax.jit(tx.init)(first)
    eager = tx.init(first)
    assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(eager)
    for name in eager:
        assert abstract[name].shape == eager[name].shape
        assert abstract[name].dtype == eager[name].dtype
        np.testing.assert_array_equal(np.asarray(traced[name]), np.asarray(eager[name]))
    assert not tx.optimizer.built  # the blueprint is never built
    step = jax.jit(tx.apply)
    for params in (first, second):
        state = tx.init(params)
        grads = jax.tree_util.tree_map(lambda p: p * SCALE, params)
        new_params, new_state = step(grads, state, params)
        reference = lso()
        flat = [ls.Variable(x) for x in jax.tree_util.tree_leaves(params)]
        reference.apply(jax.tree_util.tree_leaves(grads), flat)
        for a, v in zip(jax.tree_util.tree_leaves(new_params), flat):
            np.testing.assert_allclose(np.asarray(a), v.numpy(), rtol=1e-6, atol=1e-7)
        assert int(new_state["adam/iteration"]) == 1
    assert sorted(tx.init(second)) == sorted(tx.names(second))
    assert "adam/w_momentum" in tx.names(second) and "adam/w_momentum" not in tx.names(first)


def test_the_transform_keeps_no_array_of_its_states_alive():
    import gc
    import weakref

    import jax.numpy as jnp

    tx = transform(lso())
    params = {"w": jnp.ones((64, 64))}
    first = tx.init(params)
    refs = [weakref.ref(x) for x in first.values()]
    params, state = tx.jit(donate=False)({"w": jnp.ones((64, 64))}, first, params)
    again = tx.init(params)
    refs += [weakref.ref(x) for x in list(again.values()) + list(state.values())]
    del first, again, state
    gc.collect()
    assert all(ref() is None for ref in refs)


_SHARDED = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import lossscale as ls, lossscale.pytree as lp

    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    specs = {"w": P("data", "model"), "b": P("model"), "s": P()}
    rng = np.random.default_rng(0)
    host = {"w": rng.normal(size=(8, 6)), "b": rng.normal(size=(6,)), "s": rng.normal(size=())}
    host = {k: v.astype(np.float32) for k, v in host.items()}
    grads = [{k: (rng.normal(size=v.shape) * 64).astype(np.float16) for k, v in host.items()}
             for _ in range(3)]
    grads[1]["w"][0, 0] = np.inf

    def run(place):
        tx = lp.transform(ls.LossScaleOptimizer(ls.optimizers.Adam(0.05), initial_scale=64.0))
        params = {k: place(k, v) for k, v in host.items()}
        state = tx.init(params)
        step = tx.jit()
        for g in grads:
            params, state = step({k: place(k, v) for k, v in g.items()}, state, params)
        return tx, params, state

    sharded = lambda k, v: jax.device_put(v, NamedSharding(mesh, specs[k]))
    tx, params, state = run(sharded)
    _, plain_params, plain_state = run(lambda k, v: jnp.asarray(v))
    spec = lambda x: list(x.sharding.spec) if hasattr(x.sharding, "spec") else "single"
    print(json.dumps({
        "params": {k: spec(v) for k, v in params.items()},
        "state": {k: spec(v) for k, v in state.items()},
        "devices": {k: len(v.sharding.device_set) for k, v in state.items()},
        "param_diff": max(float(np.max(np.abs(np.asarray(params[k]) - np.asarray(plain_params[k]))))
                          for k in host),
        "state_diff": max(float(np.max(np.abs(np.asarray(state[k], np.float64)
                                               - np.asarray(plain_state[k], np.float64))))
                          for k in state),
        "iteration": int(state["adam/iteration"]),
    }))
""")


def test_sharded_step_keeps_sharding_and_matches_unsharded():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    out = subprocess.run(
        [sys.executable, "-c", _SHARDED], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    w, b, s = ["data", "model"], ["model"], []
    assert result["params"] == {"w": w, "b": b, "s": s}
    assert result["state"] == {
        "adam/b_momentum": b,
        "adam/b_velocity": b,
        "adam/iteration": s,
        "adam/learning_rate": s,
        "adam/s_momentum": s,
        "adam/s_velocity": s,
        "adam/w_momentum": w,
        "adam/w_velocity": w,
        "loss_scale_optimizer/dynamic_scale": s,
        "loss_scale_optimizer/step_counter": s,
    }
    assert set(result["devices"].values()) == {4}
    assert result["iteration"] == 2
    assert result["param_diff"] <= 1e-6 and result["state_diff"] <= 1e-6


def test_transform_repr_and_class():
    tx = transform(optimizers.SGD(0.1))
    assert isinstance(tx, Transform)
    assert repr(tx) == "<Transform optimizer=<SGD name='sgd' built=False>>"


def test_docstring_examples():
    import doctest

    from lossscale.pytree import _transform

    result = doctest.testmod(_transform, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "entry, value, rule",
    [
        ("dynamic_scale", np.nan, "`scale` must be a normal float32 number > 0"),
        ("dynamic_scale", -4.0, "`scale` must be a normal float32 number > 0"),
        ("step_counter", -2, "`counter` must be an integer >= 0"),
        ("adam/iteration", -1, "the optimizer's step count must be an integer >= 0"),
    ],
)
def test_check_refuses_a_restored_state_no_step_could_leave(rng, entry, value, rule):
    import jax.numpy as jnp

    tx = transform(lso())
    params = nested([jnp.asarray(a) for a in random_arrays(rng)])
    state = tx.init(params)
    tx.check(state)
    name = entry if "/" in entry else f"loss_scale_optimizer/{entry}"
    name = next(n for n in state if n.endswith(name.split("/", 1)[1]) and n.startswith(name[:4]))
    restored = OptimizerState({**state, name: jnp.asarray(value, state[name].dtype)})
    with pytest.raises(ValueError, match=re.escape(rule)) as info:
        tx.check(restored)
    assert f"({name})" in str(info.value) and str(info.value).endswith("Restore a valid state.")
