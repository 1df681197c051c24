"""What diagnostics cost: `diagnostics_every=100`, against the same steps without.

One timed "step" of these rows is a window of `EVERY` optimizer steps, the
first of which is measured (`LossScaleOptimizer(..., diagnostics_every=EVERY)`
or `dynamic_loss_scale(..., diagnostics_every=EVERY)`): a median over
windows is the cost per step amortised over the cadence, which a median of
single steps would hide. Compare each `-on` row with its `-off` row, run
side by side (`--interleave`, alternating rounds).
"""

from lossscale.bench import frameworks, workloads
from lossscale.bench.registry import implementation
from lossscale.bench.timing import Stepper

EVERY = 100


def _optimizer(diagnostics):
    import lossscale as ls

    opt = ls.LossScaleOptimizer(
        ls.optimizers.Adam(learning_rate=1e-3),
        initial_scale=workloads.LOSS_SCALE,
        dynamic_growth_steps=workloads.GROWTH_STEPS,
        diagnostics_every=EVERY if diagnostics else None,
    )
    opt.scale_loss(1.0)
    return opt


def _torch(workload, diagnostics):
    torch, device, params, grads = frameworks.torch_tensors(workload)
    opt = _optimizer(diagnostics)
    live = [g.clone() for g in grads]

    def window():
        for _ in range(EVERY):
            # Fused Adam unscales in place: each step gets the scaled
            # gradients again (the same copy in both rows).
            torch._foreach_copy_(live, grads)
            opt.apply(live, params)

    return Stepper(step=window, sync=frameworks.torch_sync(torch, device))


def _jax(workload, diagnostics):
    jax = frameworks.jax_for(workload)
    params, grads = frameworks.jax_arrays(jax, workload)
    opt = _optimizer(diagnostics)
    opt.build(params)
    apply = jax.jit(
        lambda params, values, grads: opt.stateless_apply(values, grads, params),
        donate_argnums=(0, 1),
    )
    state = {"optimizer": [v.value for v in opt.variables], "params": params}

    def window():
        for _ in range(EVERY):
            state["params"], state["optimizer"] = apply(state["params"], state["optimizer"], grads)
        return state["params"]

    return Stepper(step=window, sync=jax.block_until_ready)


def _optax(workload, diagnostics):
    jax = frameworks.jax_for(workload)
    import optax

    import lossscale.optax

    params, grads = frameworks.jax_arrays(jax, workload)
    tx = lossscale.optax.dynamic_loss_scale(
        optax.adam(1e-3, eps=1e-7),
        initial_scale=workloads.LOSS_SCALE,
        dynamic_growth_steps=workloads.GROWTH_STEPS,
        diagnostics_every=EVERY if diagnostics else None,
    )

    def apply(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    apply = jax.jit(apply, donate_argnums=(0, 1))
    state = [params, tx.init(params)]

    def window():
        for _ in range(EVERY):
            state[:] = apply(*state, grads)
        return state[0]

    return Stepper(step=window, sync=jax.block_until_ready)


for _backend, _make, _requires, _what in (
    ("torch", _torch, ("torch",), "LossScaleOptimizer(Adam), opt.apply on torch tensors"),
    ("jax", _jax, ("jax",), "LossScaleOptimizer(Adam), jax.jit(opt.stateless_apply)"),
    ("optax", _optax, ("jax", "optax"), "dynamic_loss_scale(optax.adam) under jax.jit"),
):
    for _on in (False, True):
        implementation(
            f"diagnostics-{'on' if _on else 'off'}-{_backend}",
            "ours" if _on else "baseline",
            f"{EVERY} steps of {_what}, "
            + (f"diagnostics_every={EVERY}" if _on else "no diagnostics"),
            requires=_requires,
            devices=("cpu", "cuda"),
        )(lambda workload, _make=_make, _on=_on: _make(workload, _on))
del _backend, _make, _requires, _what, _on
