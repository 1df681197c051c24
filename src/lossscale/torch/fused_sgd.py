"""torch's fused SGD with momentum, whose first step cannot be skipped on the device.

`torch.optim.SGD(momentum=..., fused=True)` takes torch's AMP protocol: a
scaler hands it `found_inf` as a device tensor and its kernel skips the
update where the flag is 1, with no host read. On its first step, though,
torch makes the momentum buffers with `torch.empty_like` and leaves filling
them to the kernel (its `is_first_step`); when `found_inf` skips that
kernel, the buffers stay uninitialised and are stored in the optimizer's
state anyway, and the next applied step adds whatever that memory held to
the weights (torch 2.13; `torch.amp.GradScaler` steps it this way too).
Until the buffers exist, lossscale's `GradScaler` and `TorchAdapter` read
the overflow flag on the host for such an optimizer, as torch does for
every optimizer without a fused kernel, and do not step it at all when the
step overflows: one read per step until the first applied one.
"""

from typing import Any


def makes_momentum_buffers(optimizer: Any) -> bool:
    """Whether `optimizer.step()` would now run torch's fused SGD's first step.

    That is, `optimizer` is a `torch.optim.SGD` whose fused kernel takes the
    AMP protocol, and a fused param group with momentum has no buffer yet
    for its first parameter with a gradient. torch makes every buffer of a
    group at once (a group where only some exist is an error in torch), so
    the first such parameter tells.

    Args:
        optimizer: Any optimizer (`False` for all but torch's fused SGD).
    """
    import torch

    if not isinstance(optimizer, torch.optim.SGD) or not getattr(
        optimizer, "_step_supports_amp_scaling", False
    ):
        return False
    state = optimizer.state
    for group in optimizer.param_groups:
        if group["momentum"] == 0 or not group.get("fused"):
            continue
        first = next((p for p in group["params"] if p.grad is not None), None)
        if first is not None and "momentum_buffer" not in state.get(first, ()):
            return True
    return False
