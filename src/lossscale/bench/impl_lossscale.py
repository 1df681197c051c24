"""Ours: `LossScaleOptimizer(Adam)` on NumPy, torch and JAX arrays; AdamW and SGD on torch."""

from lossscale.bench import frameworks, workloads
from lossscale.bench.registry import implementation
from lossscale.bench.timing import Stepper


def _optimizer(adamw=False, sgd=False):
    import lossscale as ls

    if adamw:  # the weight decay of the torch AdamW rows (Keras's default)
        inner = ls.optimizers.AdamW(learning_rate=1e-3, weight_decay=0.004)
    elif sgd:  # the torch SGD rows' momentum
        inner = ls.optimizers.SGD(learning_rate=1e-3, momentum=0.9)
    else:
        inner = ls.optimizers.Adam(learning_rate=1e-3)
    opt = ls.LossScaleOptimizer(
        inner,
        initial_scale=workloads.LOSS_SCALE,
        dynamic_growth_steps=workloads.GROWTH_STEPS,
    )
    opt.scale_loss(1.0)  # what a training step does first; the gradients come pre-scaled
    return opt


@implementation(
    "lossscale-numpy", "ours", "lossscale LossScaleOptimizer(Adam), opt.apply on NumPy arrays"
)
def numpy_adam(workload):
    params, grads = workloads.arrays(workload)
    opt = _optimizer()
    return Stepper(step=lambda: opt.apply(grads, params))


@implementation(
    "lossscale-torch",
    "ours",
    "lossscale LossScaleOptimizer(Adam), opt.apply on torch tensors",
    requires=("torch",),
    devices=("cpu", "cuda"),
)
def torch_adam(workload, adamw=False, sgd=False):
    torch, device, params, grads = frameworks.torch_tensors(workload)
    opt = _optimizer(adamw, sgd)
    # Fused Adam unscales the gradients in place (as GradScaler does); give
    # every step the scaled gradients, untimed, as the GradScaler peers get.
    live = [g.clone() for g in grads]
    return Stepper(
        step=lambda: opt.apply(live, params),
        sync=frameworks.torch_sync(torch, device),
        prepare=lambda: torch._foreach_copy_(live, grads),
    )


@implementation(
    "lossscale-torch-adamw",
    "ours",
    "lossscale LossScaleOptimizer(AdamW), opt.apply on torch tensors",
    requires=("torch",),
    devices=("cpu", "cuda"),
)
def torch_adamw(workload):
    return torch_adam(workload, adamw=True)


@implementation(
    "lossscale-torch-sgd-momentum",
    "ours",
    "lossscale LossScaleOptimizer(SGD(momentum=0.9)), opt.apply on torch tensors",
    requires=("torch",),
    devices=("cpu", "cuda"),
)
def torch_sgd_momentum(workload):
    return torch_adam(workload, sgd=True)


@implementation(
    "lossscale-torch-optimizer-adamw",
    "ours",
    "torch.amp.GradScaler + lossscale.torch.Optimizer(AdamW)",
    requires=("torch",),
    devices=("cpu", "cuda"),
)
def torch_optimizer_adamw(workload):
    import lossscale as ls
    import lossscale.torch

    torch, device, params, grads = frameworks.torch_tensors(workload)
    params = [torch.nn.Parameter(p) for p in params]
    live = [g.clone() for g in grads]
    for p, g in zip(params, live):
        p.grad = g
    opt = lossscale.torch.Optimizer(
        params, ls.optimizers.AdamW(learning_rate=1e-3, weight_decay=0.004)
    )
    scaler = torch.amp.GradScaler(
        device.type, init_scale=workloads.LOSS_SCALE, growth_interval=workloads.GROWTH_STEPS
    )
    scaler.scale(torch.ones((), device=device))  # creates the scale, as a forward pass does

    def step():
        scaler.step(opt)
        scaler.update()

    return Stepper(
        step=step,
        sync=frameworks.torch_sync(torch, device),
        prepare=lambda: torch._foreach_copy_(live, grads),
    )


@implementation(
    "lossscale-jax",
    "ours",
    "lossscale LossScaleOptimizer(Adam), jax.jit(opt.stateless_apply), state donated",
    requires=("jax",),
    devices=("cpu", "cuda"),
)
def jax_adam(workload):
    jax = frameworks.jax_for(workload)
    params, grads = frameworks.jax_arrays(jax, workload)
    opt = _optimizer()
    opt.build(params)
    # Donated in the order the outputs come back (params, then optimizer
    # state): XLA pairs each output with the first donated input of its
    # shape, so the reverse order would copy every buffer (docs/jax.md).
    apply = jax.jit(
        lambda params, values, grads: opt.stateless_apply(values, grads, params),
        donate_argnums=(0, 1),
    )
    state = {"optimizer": [v.value for v in opt.variables], "params": params}

    def step():
        state["params"], state["optimizer"] = apply(state["params"], state["optimizer"], grads)
        return state["params"]

    return Stepper(step=step, sync=jax.block_until_ready)


@implementation(
    "lossscale-torch-compiled",
    "ours",
    "lossscale LossScaleOptimizer(Adam), opt.apply in torch.compile(fullgraph=True)",
    requires=("torch",),
    devices=("cpu", "cuda"),
)
def torch_adam_compiled(workload, options=None):
    torch, device, params, grads = frameworks.torch_tensors(workload)
    opt = _optimizer()
    opt.build(params)  # outside the compiled function: creating state is not traced
    live = [g.clone() for g in grads]
    compiled = torch.compile(lambda: opt.apply(live, params), fullgraph=True, options=options)
    return Stepper(
        step=compiled,
        sync=frameworks.torch_sync(torch, device),
        prepare=lambda: torch._foreach_copy_(live, grads),
    )


@implementation(
    "lossscale-torch-compiled-lean",
    "ours",
    "lossscale LossScaleOptimizer(Adam), opt.apply in torch.compile(fullgraph=True) with "
    "Dynamo's tensor guards only and no Inductor size asserts (docs/torch.md)",
    requires=("torch",),
    devices=("cpu", "cuda"),
)
def torch_adam_compiled_lean(workload):
    import torch

    return torch_adam_compiled(
        workload,
        options={
            "guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe,
            "size_asserts": False,
        },
    )
