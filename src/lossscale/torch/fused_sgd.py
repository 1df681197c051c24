"""torch's fused SGD with momentum, whose first step cannot be skipped on the device.

Its first step makes the momentum buffers with `torch.empty_like` and leaves
filling them to the kernel; when `found_inf` skips that kernel, the buffers
stay uninitialised and are kept. Until they exist, `GradScaler` and
`TorchAdapter` read the overflow flag on the host and do not step it at all
on an overflow.
"""

from typing import Any


def makes_momentum_buffers(optimizer: Any) -> bool:
    """Whether `optimizer.step()` would now run torch's fused SGD's first step.

    torch makes every buffer of a group at once, so the group's first
    parameter with a gradient tells.
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
