"""Model-parallel steps inside `jax.shard_map`, each device holding its own block.

Run as `python -m tests.workers.jax_shard_map_worker OUT_FILE` with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`: a (1024, 1024) kernel
(each device's block 2**18 elements: the finite check's large-array path,
its sums first), a (32, 64) one and a bias (64,) (the small-array path) are
sharded over a 4-device "model" axis, each device a block of columns, and
each interface takes `STEPS` steps on gradient blocks inside `shard_map`
(its default `check_vma=True`) with `axis_name="model"`. At step
`POISONED[0]` an inf sits in the last device's block of the large kernel
alone, at `POISONED[1]` a NaN in the second device's block of the small
one; at the last step zeros, a float16 subnormal and a value near float16's
maximum sit in different devices' blocks. The same
steps on global arrays under `jax.jit` (one decision by construction) are
the reference. Writes, per interface and option, whether the parameters and
the whole optimizer state equal the reference bit for bit, the scales, and
whether the summaries agree; and whether the same step without `axis_name`
is refused at trace time.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale as ls
import lossscale.optax as lso

STEPS = 6
POISONED = (2, 4)
SHAPES = ((1024, 1024), (32, 64), (64,))
BLOCKS = ((1024, 256), (32, 16), (16,))
SPECS = (P(None, "model"), P(None, "model"), P("model"))
OPTIONS = {
    "default": {},
    "telemetry": {"telemetry": True},
    "headroom": {"growth_policy": "headroom"},
    "hysteresis": {"hysteresis": 2, "telemetry": True},
    "statistics": {"growth_policy": "statistics", "diagnostics_every": 2},
    "diagnostics": {"diagnostics_every": 1, "telemetry": True},
}
# Inside `shard_map`, telemetry alone is left out: "hysteresis" and
# "diagnostics" run with it (each run compiles two programs); `pmap` takes it.
SHARD_MAP_OPTIONS = [option for option in OPTIONS if option != "telemetry"]
SETTINGS = {"initial_scale": 2.0**8, "dynamic_growth_steps": 2}


def data():
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in SHAPES]
    grads = []
    for k in range(STEPS):
        step = [jnp.asarray(rng.normal(size=s) * 2.0**8, jnp.float32) for s in SHAPES]
        if k == POISONED[0]:
            step[0] = step[0].at[5, 1023].set(jnp.inf)  # the last device's columns
        if k == POISONED[1]:
            step[1] = step[1].at[3, 20].set(jnp.nan)  # the second device's columns
        if k == STEPS - 1:  # the float16 range differs by block (measured last here)
            step[0] = step[0].at[:4, :8].set(0.0)  # zeros in the first device's block
            step[0] = step[0].at[10, 300].set(1e-6)  # a subnormal in the second's
            step[1] = step[1].at[0, 40].set(40000.0)  # near float16's maximum, the third's
        grads.append(step)
    return params, grads


def _spec_of(x):
    """Per-parameter state is sharded like its parameter; the rest is replicated."""
    shape = tuple(getattr(x, "shape", ()))
    for s, spec in zip(SHAPES, SPECS):
        if shape == s:
            return spec
    return P()


def _place(mesh, tree):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, _spec_of(x))), tree)


def _same(a, b):
    """Every leaf equal, value for value (NaN where NaN: a peak over a NaN is one)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _equal(x, y):
    nan = np.issubdtype(x.dtype, np.floating)
    return x.dtype == y.dtype and np.array_equal(x, y, equal_nan=nan)


def _optax_step(tx):
    """One optax step of `tx`: `(params, state, grads) -> (params, state)`."""

    def run(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    return run


def optax_run(mesh, option, axis_name="model"):
    params, grads = data()
    sharded_tx = lso.dynamic_loss_scale(
        optax.adam(1e-2), **SETTINGS, **OPTIONS[option], axis_name=axis_name
    )
    tx = lso.dynamic_loss_scale(optax.adam(1e-2), **SETTINGS, **OPTIONS[option])

    state = tx.init(params)
    specs = jax.tree.map(_spec_of, state)
    sharded = jax.jit(
        jax.shard_map(
            _optax_step(sharded_tx),
            mesh=mesh,
            in_specs=(list(SPECS), specs, list(SPECS)),
            out_specs=(list(SPECS), specs),
        )
    )
    p, s = _place(mesh, params), _place(mesh, state)
    ref_p, ref_s = params, state
    scales = []
    for g in grads:
        p, s = sharded(p, s, _place(mesh, g))
        ref_p, ref_s = jax.jit(_optax_step(tx))(ref_p, ref_s, g)
        scales.append(float(lso.loss_scale(s)))
    return {
        "same": _same((p, s), (ref_p, ref_s)),
        "scales": scales,
        "same_summary": repr(lso.summary(s)) == repr(lso.summary(ref_s)),
    }


def wrapper_run(mesh, option, axis_name="model"):
    params, grads = data()

    def make(axis, shapes):
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-2), **SETTINGS, **OPTIONS[option], **axis)
        opt.build([jnp.zeros(s, jnp.float32) for s in shapes])
        return opt

    ref = make({}, SHAPES)
    # Inside `shard_map` each device sees its block: built on the block shapes.
    opt = make({"axis_name": axis_name} if axis_name else {}, BLOCKS)
    values = [v.value for v in ref.variables]
    specs = [_spec_of(v) for v in values]
    sharded = jax.jit(
        jax.shard_map(
            lambda p, v, g: opt.stateless_apply(v, g, p),
            mesh=mesh,
            in_specs=(list(SPECS), specs, list(SPECS)),
            out_specs=(list(SPECS), specs),
        )
    )
    reference = jax.jit(lambda p, v, g: ref.stateless_apply(v, g, p))
    p, v = (
        _place(mesh, params),
        [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(values, specs)],
    )
    ref_p, ref_v = params, values
    scales = []
    scale_index = [i for i, var in enumerate(ref.variables) if var is ref.dynamic_scale][0]
    for g in grads:
        p, v = sharded(p, v, _place(mesh, g))
        ref_p, ref_v = reference(ref_p, ref_v, g)
        scales.append(float(v[scale_index]))
    # (Every state value compared: the summary is read from them.)
    return {"same": _same((p, v), (ref_p, ref_v)), "scales": scales}


def optax_pmap_run(option):
    """`jax.pmap` over the rows: each device its own (1024,) row, the same decision."""
    rng = np.random.default_rng(1)
    params = jnp.asarray(rng.normal(size=(4, 1024)), jnp.float32)
    grads = [jnp.asarray(rng.normal(size=(4, 1024)) * 2.0**8, jnp.float32) for _ in range(STEPS)]
    grads[POISONED[0]] = grads[POISONED[0]].at[3, 7].set(jnp.inf)  # the last device's row
    sharded_tx = lso.dynamic_loss_scale(
        optax.adam(1e-2), **SETTINGS, **OPTIONS[option], axis_name="rows"
    )
    tx = lso.dynamic_loss_scale(optax.adam(1e-2), **SETTINGS, **OPTIONS[option])

    row_state = sharded_tx.init(params[0])
    s = jax.tree.map(lambda x: jnp.stack([x] * 4), row_state)
    p, ref_p, ref_s = params, params, tx.init(params)
    mapped = jax.pmap(_optax_step(sharded_tx), axis_name="rows")
    for g in grads:
        p, s = mapped(p, s, g)
        ref_p, ref_s = jax.jit(_optax_step(tx))(ref_p, ref_s, g)
    scales = np.asarray(s.loss_scale_state.scale)
    return {
        "same": _same(p, ref_p) and bool(np.all(scales == float(lso.loss_scale(ref_s)))),
        "scales": [float(lso.loss_scale(ref_s))],
    }


def refused_without_axis(mesh, run):
    try:
        run(mesh, "default", axis_name=None)
    except Exception as error:  # shard_map's replication check: the scale would vary
        return type(error).__name__
    return "accepted"


def main(out):
    mesh = jax.make_mesh((4,), ("model",))
    results = {}
    for name, run in (("optax", optax_run), ("wrapper", wrapper_run)):
        for option in SHARD_MAP_OPTIONS:
            results[f"{name}-{option}"] = run(mesh, option)
        results[f"{name}-refused"] = refused_without_axis(mesh, run)
    for option in ("default", "telemetry"):
        results[f"pmap-{option}"] = optax_pmap_run(option)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
