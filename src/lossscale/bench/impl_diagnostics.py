"""What diagnostics cost: `diagnostics_every=100`, against the same steps without.

One timed "step" is a window of `EVERY` optimizer steps, the first of which
is measured: the cost per step amortised over the cadence. Compare each
`-on` row with its `-off` row, run side by side (`--interleave`).
"""

from lossscale.bench import frameworks, impl_lossscale, workloads
from lossscale.bench.registry import implementation
from lossscale.bench.timing import Stepper

EVERY = 100


def _optimizer(diagnostics):
    return impl_lossscale.optimizer(diagnostics_every=EVERY if diagnostics else None)


def _torch(workload, diagnostics):
    torch, device, params, grads = frameworks.torch_tensors(workload)
    opt = _optimizer(diagnostics)
    live = [g.clone() for g in grads]

    def window():
        for _ in range(EVERY):
            # Fused Adam unscales in place: each step gets the scaled gradients again.
            torch._foreach_copy_(live, grads)
            opt.apply(live, params)

    return Stepper(step=window, sync=frameworks.torch_sync(torch, device))


def _jax(workload, diagnostics):
    jax = frameworks.jax_for(workload)
    params, grads = frameworks.jax_arrays(jax, workload)
    opt = _optimizer(diagnostics)
    opt.build(params)
    return frameworks.jax_stepper(jax, opt, params, grads, steps=EVERY)


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
    return frameworks.optax_stepper(jax, tx, params, grads, steps=EVERY)


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
