"""JAX peer: `optax.adam` with `jmp.DynamicLossScale`, one jitted step."""

from lossscale.bench import frameworks, workloads
from lossscale.bench.registry import implementation
from lossscale.bench.timing import Stepper


@implementation(
    "optax-jmp",
    "peer",
    "optax.adam + jmp.DynamicLossScale under jax.jit, state donated",
    requires=("jax", "optax", "jmp"),
    devices=("cpu", "cuda"),
)
def optax_jmp(workload):
    jax = frameworks.jax_for(workload)
    import jmp
    import optax

    params, grads = frameworks.jax_arrays(jax, workload)
    tx = optax.adam(1e-3, eps=1e-7)

    def apply(params, opt_state, loss_scale, grads):
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, loss_scale.adjust(finite)

    apply = jax.jit(apply, donate_argnums=(0, 1, 2))
    state = [
        params,
        tx.init(params),
        jmp.DynamicLossScale(
            jax.numpy.float32(workloads.LOSS_SCALE), period=workloads.GROWTH_STEPS
        ),
    ]

    def step():
        state[:] = apply(*state, grads)
        return state[0]

    return Stepper(step=step, sync=jax.block_until_ready)


@implementation(
    "lossscale-optax",
    "ours",
    "lossscale.optax.dynamic_loss_scale(optax.adam) under jax.jit, state donated",
    requires=("jax", "optax"),
    devices=("cpu", "cuda"),
)
def lossscale_optax(workload):
    jax = frameworks.jax_for(workload)
    import optax

    import lossscale.optax

    params, grads = frameworks.jax_arrays(jax, workload)
    tx = lossscale.optax.dynamic_loss_scale(
        optax.adam(1e-3, eps=1e-7),
        initial_scale=workloads.LOSS_SCALE,
        dynamic_growth_steps=workloads.GROWTH_STEPS,
    )
    return frameworks.optax_stepper(jax, tx, params, grads)


@implementation(
    "optax-adam-unscaled",
    "baseline",
    "optax.adam under jax.jit, state donated, no loss scaling (the reference for lossscale-optax)",
    requires=("jax", "optax"),
    devices=("cpu", "cuda"),
)
def optax_adam_unscaled(workload):
    jax = frameworks.jax_for(workload)
    import optax

    params, _ = frameworks.jax_arrays(jax, workload)
    _, grads = workloads.arrays(workload, loss_scaled=False)
    grads = [jax.numpy.asarray(g) for g in grads]
    return frameworks.optax_stepper(jax, optax.adam(1e-3, eps=1e-7), params, grads)
