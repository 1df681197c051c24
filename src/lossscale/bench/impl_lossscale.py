"""Ours: `LossScaleOptimizer(Adam)` on NumPy, torch and JAX arrays; AdamW and SGD on torch."""

from lossscale.bench import frameworks, workloads
from lossscale.bench.registry import TORCH, implementation
from lossscale.bench.timing import Stepper


def optimizer(adamw=False, sgd=False, **options):
    """Our wrapper (of Adam, AdamW or SGD) as the rows use it, its scale created."""
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
        **options,
    )
    opt.scale_loss(1.0)  # what a training step does first; the gradients come pre-scaled
    return opt


@implementation(
    "lossscale-numpy", "ours", "lossscale LossScaleOptimizer(Adam), opt.apply on NumPy arrays"
)
def numpy_adam(workload):
    params, grads = workloads.arrays(workload)
    opt = optimizer()
    return Stepper(step=lambda: opt.apply(grads, params))


@implementation(
    "lossscale-torch",
    "ours",
    "lossscale LossScaleOptimizer(Adam), opt.apply on torch tensors",
    **TORCH,
)
def torch_adam(workload, adamw=False, sgd=False):
    torch, device, params, grads = frameworks.torch_tensors(workload)
    opt = optimizer(adamw, sgd)
    # Fused Adam unscales the gradients in place: restore them, untimed.
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
    **TORCH,
)
def torch_adamw(workload):
    return torch_adam(workload, adamw=True)


@implementation(
    "lossscale-torch-sgd-momentum",
    "ours",
    "lossscale LossScaleOptimizer(SGD(momentum=0.9)), opt.apply on torch tensors",
    **TORCH,
)
def torch_sgd_momentum(workload):
    return torch_adam(workload, sgd=True)


@implementation(
    "lossscale-torch-optimizer-adamw",
    "ours",
    "torch.amp.GradScaler + lossscale.torch.Optimizer(AdamW)",
    **TORCH,
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
    opt = optimizer()
    opt.build(params)
    return frameworks.jax_stepper(jax, opt, params, grads)


@implementation(
    "lossscale-torch-compiled",
    "ours",
    "lossscale LossScaleOptimizer(Adam), opt.apply in torch.compile(fullgraph=True)",
    **TORCH,
)
def torch_adam_compiled(workload, options=None):
    torch, device, params, grads = frameworks.torch_tensors(workload)
    opt = optimizer()
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
    **TORCH,
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
