"""Sharded parameters: placement of the state, one global skip, one compile.

Four forced host devices, in a subprocess (the device count is fixed when
JAX starts). `dynamic_loss_scale` and the `OptaxAdapter` adapter place
the scalars they and optax make (the scale, optax's `count`) replicated
over the parameters' mesh, so the first jitted call sees the shardings of
every later one.
"""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, tempfile
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import lossscale as ls, lossscale.optax as lso
    from lossscale import saving

    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    specs = {"w": P("data", "model"), "b": P("model")}
    rng = np.random.default_rng(0)
    host = {"w": rng.normal(size=(8, 6)).astype(np.float32),
            "b": rng.normal(size=(6,)).astype(np.float32)}
    grads = [{k: (rng.normal(size=v.shape) * 64).astype(np.float32) for k, v in host.items()}
             for _ in range(5)]
    grads[2]["w"][7, 5] = np.inf  # on one device only
    place = lambda tree: {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
                          for k, v in tree.items()}
    spec = lambda x: list(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else "single"
    out = {}

    tx = lso.dynamic_loss_scale(optax.adam(0.01), initial_scale=64.0, dynamic_growth_steps=2)
    params = place(host)
    state = tx.init(params)
    out["init"] = {jax.tree_util.keystr(p): spec(x)
                   for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}

    def apply(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(apply, donate_argnums=(0, 1))
    plain_params, plain_state = {k: jnp.asarray(v) for k, v in host.items()}, None
    plain_state = tx.init(plain_params)
    plain_step = jax.jit(apply)
    skip = []
    for k, g in enumerate(grads):
        before = {k_: np.asarray(v) for k_, v in params.items()}
        params, state = step(params, state, place(g))
        plain_params, plain_state = plain_step(plain_params, plain_state,
                                               {k_: jnp.asarray(v) for k_, v in g.items()})
        skip.append(all(np.array_equal(before[k_], np.asarray(v)) for k_, v in params.items()))
    out["skip"] = skip
    out["scales"] = float(state.scale), float(plain_state.scale)
    out["compiles"] = step._cache_size()
    out["after"] = {jax.tree_util.keystr(p): spec(x)
                    for p, x in jax.tree_util.tree_flatten_with_path((params, state))[0]}
    out["diff"] = max(float(np.max(np.abs(np.asarray(params[k]) - np.asarray(plain_params[k]))))
                      for k in host)

    # A checkpoint restored into a sharded target keeps every sharding.
    path = tempfile.mkdtemp() + "/state.safetensors"
    saving.save(tx, path, state=state)
    target = jax.tree_util.tree_map(
        lambda a, x: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=x.sharding),
        jax.eval_shape(tx.init, params), state)
    restored = saving.restore(tx, path, state=target)
    out["restored"] = all(
        r.sharding == x.sharding and np.array_equal(np.asarray(r), np.asarray(x))
        for r, x in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)))
    params, restored = step(params, restored, place(grads[0]))
    out["compiles_after_restore"] = step._cache_size()

    # Gradients sharded otherwise than their parameters: XLA may then give an
    # output another sharding than its input had, and the second call
    # compiles again; outputs pinned to the shardings `init` gave compile once.
    other = lambda g: {"w": jax.device_put(g["w"], NamedSharding(mesh, P("model", None))),
                       "b": jax.device_put(g["b"], NamedSharding(mesh, P()))}
    fresh = place(host)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, (fresh, tx.init(fresh)))
    free, pinned = jax.jit(apply), jax.jit(apply, out_shardings=shardings)
    for run in (free, pinned):
        p, s = place(host), tx.init(place(host))
        for g in grads:
            p, s = run(p, s, other(g))
    out["other_grads_compiles"] = [free._cache_size(), pinned._cache_size()]

    # The adapter: optax's count is a variable placed like lossscale's own scalars.
    opt = ls.LossScaleOptimizer(lso.OptaxAdapter(optax.adam(0.01)), initial_scale=64.0)
    leaves = [params["b"], params["w"]]
    opt.build(leaves)
    out["adapter"] = {v.path: spec(v.value) for v in opt.variables}
    adapter_step = jax.jit(opt.stateless_apply)
    values = [v.value for v in opt.variables]
    for g in grads:
        g = place(g)
        leaves, values = adapter_step(values, [g["b"], g["w"]], leaves)
    out["adapter_compiles"] = adapter_step._cache_size()

    # A mesh of one device: the scalars are placed over it too, as the
    # jitted step returns them.
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P())
    params = jax.device_put(host, one)
    state = tx.init(params)
    out["one_device_init"] = spec(state.scale)
    one_step = jax.jit(lambda p, s, g: apply(p, s, g))  # a cache of its own
    for g in grads[:3]:
        params, state = one_step(params, state, jax.device_put(g, one))
    out["one_device_compiles"] = one_step._cache_size()
    print(json.dumps(out))
""")


def test_sharded_parameters_one_global_skip_one_compile():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    w, b, replicated = ["data", "model"], ["model"], []
    assert out["init"] == {
        ".scale": replicated,
        ".counter": replicated,
        ".last_step_skipped": replicated,
        ".inner_state[0].count": replicated,
        ".inner_state[0].mu['b']": b,
        ".inner_state[0].mu['w']": w,
        ".inner_state[0].nu['b']": b,
        ".inner_state[0].nu['w']": w,
    }
    # The inf on one device skipped the step on all of them, once.
    assert out["skip"] == [False, False, True, False, False]
    assert out["scales"] == [128.0, 128.0]  # 64, then 128 (growth), 64 (backoff), 128
    assert out["compiles"] == 1 and out["compiles_after_restore"] == 1
    assert out["after"]["[0]['w']"] == w and out["after"]["[1].scale"] == replicated
    assert out["after"]["[1].inner_state[0].count"] == replicated
    assert out["diff"] <= 1e-6
    assert out["restored"] is True
    assert out["adapter"]["optax_optimizer/0/count"] == replicated
    assert out["adapter"]["optax_optimizer/0/mu/1"] == w
    assert out["adapter_compiles"] == 1
    assert out["other_grads_compiles"] == [2, 1]
    assert out["one_device_init"] == replicated and out["one_device_compiles"] == 1
