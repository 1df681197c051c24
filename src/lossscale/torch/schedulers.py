"""`AppliedStepScheduler`: a torch LR scheduler that does not count skipped steps.

A torch scheduler also advances on steps a loss scaler skipped (lossscale's
own schedules read `iterations` and do not). This wrapper steps it only after
an applied step, at the cost of one host read per `step()` call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lossscale.optimizers.loss_scale_optimizer import LossScaleOptimizer
    from lossscale.torch.optimizer import Optimizer


class AppliedStepScheduler:
    """Steps a torch LR scheduler only after the optimizer's applied (not skipped) steps.

    Args:
        scheduler: A `torch.optim.lr_scheduler.LRScheduler` (LambdaLR,
            OneCycleLR, ...) of `optimizer`'s param groups.
        optimizer: A `lossscale.torch.Optimizer` or a
            `lossscale.LossScaleOptimizer`, whose `last_step_applied` is read
            at each `step()`.

    Examples:

        >>> import torch, lossscale as ls, lossscale.torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = lossscale.torch.Optimizer([p], ls.optimizers.SGD(0.1))
        >>> schedule = lossscale.torch.AppliedStepScheduler(
        ...     torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step), opt)
        >>> p.grad = torch.ones(2)
        >>> opt.found_inf = torch.tensor(1.0)   # what a GradScaler sets: overflow
        >>> opt.step(); del opt.found_inf
        >>> schedule.step()                     # skipped: the schedule stays
        >>> opt.step(); schedule.step()         # applied: it moves
        >>> opt.param_groups[0]["lr"]
        0.05
    """

    def __init__(
        self,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        optimizer: Optimizer | LossScaleOptimizer,
    ) -> None:
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ValueError(
                "`scheduler` must be a torch.optim.lr_scheduler.LRScheduler. Received: "
                f"scheduler={scheduler!r}"
            )
        if not hasattr(optimizer, "last_step_applied"):
            raise ValueError(
                "`optimizer` must report whether its last step was applied "
                "(`last_step_applied`): a lossscale.torch.Optimizer or a "
                f"lossscale.LossScaleOptimizer. Received: optimizer={optimizer!r}"
            )
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.skipped_steps = 0

    def step(self) -> None:
        """Steps the scheduler unless the optimizer's last step was skipped (one host read)."""
        applied = self.optimizer.last_step_applied
        if applied is None or bool(applied):
            self.scheduler.step()
        else:
            self.skipped_steps += 1

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The scheduler's last learning rates (torch's method)."""
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state, and the count of steps not taken."""
        return {"scheduler": self.scheduler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what `state_dict()` returned."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"scheduler", "skipped_steps"}:
            raise ValueError(
                "`state_dict` must be a dict with keys ['scheduler', 'skipped_steps'], as "
                f"AppliedStepScheduler.state_dict() returns it. Received: {state_dict!r}"[:300]
            )
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self.skipped_steps = int(state_dict["skipped_steps"])
