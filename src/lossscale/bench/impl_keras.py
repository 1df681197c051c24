"""Keras 3 peers: `keras.optimizers.LossScaleOptimizer(Adam)` on torch and on JAX.

Keras chooses its backend once per process from `KERAS_BACKEND`, so each of
these runs in a subprocess started with that variable set.
"""

from lossscale.bench import frameworks, workloads
from lossscale.bench.registry import implementation
from lossscale.bench.timing import Stepper


def _optimizer(keras):
    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(learning_rate=1e-3),
        initial_scale=workloads.LOSS_SCALE,
        dynamic_growth_steps=workloads.GROWTH_STEPS,
    )


@implementation(
    "keras-torch",
    "peer",
    "Keras 3 LossScaleOptimizer(Adam), torch backend, opt.apply",
    requires=("keras", "torch"),
    devices=("cpu", "cuda"),
    env={"KERAS_BACKEND": "torch"},
)
def keras_torch(workload):
    keras = frameworks.keras_for("torch", workload)
    torch, device = frameworks.torch_device(workload)
    params, grads = workloads.arrays(workload)
    variables = [keras.Variable(p) for p in params]
    grads = [keras.ops.convert_to_tensor(g) for g in grads]
    opt = _optimizer(keras)
    return Stepper(
        step=lambda: opt.apply(grads, variables), sync=frameworks.torch_sync(torch, device)
    )


@implementation(
    "keras-jax",
    "peer",
    "Keras 3 LossScaleOptimizer(Adam), JAX backend, jax.jit(opt.stateless_apply), state donated",
    requires=("keras", "jax"),
    devices=("cpu", "cuda"),
    env={"KERAS_BACKEND": "jax"},
)
def keras_jax(workload):
    keras = frameworks.keras_for("jax", workload)
    import jax

    params, grads = frameworks.jax_arrays(jax, workload)
    variables = [keras.Variable(p) for p in params]
    opt = _optimizer(keras)
    opt.build(variables)
    # Donated in the order the outputs come back (params, then optimizer
    # state): XLA pairs each output with the first donated input of its
    # shape, so the reverse order would copy every buffer (docs/jax.md).
    apply = jax.jit(
        lambda params, values, grads: opt.stateless_apply(values, grads, params),
        donate_argnums=(0, 1),
    )
    state = {"optimizer": [v.value for v in opt.variables], "params": [v.value for v in variables]}

    def step():
        state["params"], state["optimizer"] = apply(state["params"], state["optimizer"], grads)
        return state["params"]

    return Stepper(step=step, sync=jax.block_until_ready)
