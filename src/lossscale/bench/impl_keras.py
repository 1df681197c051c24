"""Keras 3 peers: `keras.optimizers.LossScaleOptimizer(Adam)` on torch and on JAX."""

from lossscale.bench import frameworks, workloads
from lossscale.bench.registry import implementation
from lossscale.bench.timing import Stepper


def optimizer(keras):
    """Keras's wrapper of Adam as the rows use it."""
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
    opt = optimizer(keras)
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
    opt = optimizer(keras)
    opt.build(variables)
    return frameworks.jax_stepper(jax, opt, [v.value for v in variables], grads)
