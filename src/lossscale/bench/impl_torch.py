"""PyTorch peers: `torch.amp.GradScaler` with torch's Adam / AdamW / SGD, and plain Adam.

Also ours on the same path: `lossscale.torch.GradScaler` with fused AdamW.
"""

from lossscale.bench import frameworks, workloads
from lossscale.bench.registry import TORCH, implementation
from lossscale.bench.timing import Stepper

# Keras's AdamW default; the lossscale AdamW rows use the same.
WEIGHT_DECAY = 0.004


def _with_grads(torch, params, grads):
    """`params` as `nn.Parameter`s, each holding a copy of its gradient."""
    params = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def _adam(torch, params, grads, adamw=False, **kwargs):
    params = _with_grads(torch, params, grads)
    # Keras's epsilon, so every implementation runs the same arithmetic.
    if adamw:
        return params, torch.optim.AdamW(
            params, lr=1e-3, eps=1e-7, weight_decay=WEIGHT_DECAY, **kwargs
        )
    return params, torch.optim.Adam(params, lr=1e-3, eps=1e-7, **kwargs)


def scaler_stepper(workload, scaler_kwargs, **kwargs):
    """The step of `lossscale.torch.GradScaler(**scaler_kwargs)` with torch's Adam(W)(**kwargs)."""
    return _grad_scaler_adam(workload, ours=True, scaler_kwargs=scaler_kwargs, **kwargs)


def _grad_scaler_adam(workload, adamw=False, ours=False, sgd=False, scaler_kwargs=None, **kwargs):
    torch, device, params, grads = frameworks.torch_tensors(workload)
    if sgd:
        params = _with_grads(torch, params, grads)
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kwargs)
    else:
        params, opt = _adam(torch, params, grads, adamw=adamw, **kwargs)
    scaler_class = torch.amp.GradScaler
    if ours:
        import lossscale.torch

        scaler_class = lossscale.torch.GradScaler
    scaler = scaler_class(
        device.type,
        init_scale=workloads.LOSS_SCALE,
        growth_interval=workloads.GROWTH_STEPS,
        **(scaler_kwargs or {}),
    )
    scaler.scale(torch.ones((), device=device))  # creates the scale, as a forward pass does
    live = [p.grad for p in params]

    def step():
        scaler.step(opt)
        scaler.update()

    # GradScaler unscales the gradients in place; restore them, untimed.
    return Stepper(
        step=step,
        sync=frameworks.torch_sync(torch, device),
        prepare=lambda: torch._foreach_copy_(live, grads),
    )


@implementation(
    "torch-gradscaler-fused",
    "peer",
    "torch.amp.GradScaler + torch.optim.Adam(fused=True)",
    **TORCH,
)
def grad_scaler_fused(workload):
    return _grad_scaler_adam(workload, fused=True)


@implementation(
    "torch-gradscaler-foreach",
    "peer",
    "torch.amp.GradScaler + torch.optim.Adam(foreach=True)",
    **TORCH,
)
def grad_scaler_foreach(workload):
    return _grad_scaler_adam(workload, foreach=True)


@implementation(
    "torch-gradscaler-adamw-fused",
    "peer",
    "torch.amp.GradScaler + torch.optim.AdamW(fused=True)",
    **TORCH,
)
def grad_scaler_adamw_fused(workload):
    return _grad_scaler_adam(workload, adamw=True, fused=True)


@implementation(
    "torch-gradscaler-sgd-momentum-fused",
    "peer",
    "torch.amp.GradScaler + torch.optim.SGD(momentum=0.9, fused=True)",
    **TORCH,
)
def grad_scaler_sgd_momentum_fused(workload):
    return _grad_scaler_adam(workload, sgd=True, fused=True)


@implementation(
    "lossscale-gradscaler-adamw-fused",
    "ours",
    "lossscale.torch.GradScaler + torch.optim.AdamW(fused=True)",
    **TORCH,
)
def lossscale_grad_scaler_adamw_fused(workload):
    return _grad_scaler_adam(workload, adamw=True, ours=True, fused=True)


@implementation(
    "torch-adam-fused-unscaled",
    "baseline",
    "torch.optim.Adam(fused=True), no loss scaling (the cost of scaling, not a peer)",
    **TORCH,
)
def adam_fused_unscaled(workload):
    torch, device, params, grads = frameworks.torch_tensors(workload, scaled=False)
    _, opt = _adam(torch, params, grads, fused=True)
    return Stepper(step=opt.step, sync=frameworks.torch_sync(torch, device))
