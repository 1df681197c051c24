"""How `GradScaler` steps an optimizer: torch's `step`, with a host read where a kernel cannot skip.

torch's `step` hands an optimizer with a fused kernel
(`_step_supports_amp_scaling`) the overflow flag as a device tensor, and
steps any other optimizer only after reading the flag on the host
(`_maybe_opt_step`). This scaler keeps both, and reads the flag on the host
for one more case: torch's fused SGD with momentum before its momentum
buffers exist, whose first step cannot be skipped by its kernel
(`lossscale.torch.fused_sgd`). An overflowing step then does not call the
optimizer at all, as for a non-fused optimizer; once a step has been
applied, the buffers exist and every later step is torch's, with no read.
"""

from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from lossscale.torch import fused_sgd


class ScalerStepMixin:
    """`step` and `_maybe_opt_step`: when the optimizer is stepped, and when it is not."""

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Steps `optimizer` unless this iteration's gradients overflowed (torch's `step`).

        Unscales the gradients first if `unscale_(optimizer)` was not called
        (an optimizer with a fused kernel divides them itself), and returns
        what `optimizer.step` returns, or `None` where the step is skipped.
        The stages and their errors are torch's.

        Args:
            optimizer: The `torch.optim.Optimizer` to step.
            *args, **kwargs: Passed on to `optimizer.step` (no `closure`).
        """
        if (
            self._enabled
            and "closure" not in kwargs
            and fused_sgd.makes_momentum_buffers(optimizer)
        ):
            state = self._per_optimizer_states[id(optimizer)]
            if state["stage"] is not OptState.STEPPED:  # else torch's error, below
                if state["stage"] is OptState.READY:
                    # Checked here to decide on the host; torch's `step` checks
                    # again below (this step only) and hands the kernel the scale.
                    self._check_inf_per_device(optimizer)
                if self._found_inf_on_host(state):
                    state["stage"] = OptState.STEPPED
                    return None
        return super().step(optimizer, *args, **kwargs)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        # torch reads the overflow flag on the host here (an optimizer without
        # a fused kernel).
        if self._found_inf_on_host(optimizer_state):
            return None
        return optimizer.step(*args, **kwargs)

    def _found_inf_on_host(self, optimizer_state):
        """Whether the optimizer's gradients overflowed: its flags, read on the host.

        The scale comes back in the same copy, which keeps `_scale_bound`
        exact.
        """
        device = self._scale.device
        flags = [f.to(device).reshape(()) for f in optimizer_state["found_inf_per_device"].values()]
        found, self._scale_bound = torch.stack([torch.stack(flags).sum(), self._scale]).tolist()
        return bool(found)
