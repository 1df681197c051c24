"""What a step may ask of its kernel: the one place that decides the fast paths.

`Optimizer._step` reads the plan to pass `keep` down or gate the step under
`ops.cond`; `LossScaleOptimizer` and `lossscale.torch.Optimizer` read
`takes_grad_scale` to leave the loss scale in the gradients for the kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lossscale.backends.kernel import Kernel


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The fast paths one step of an optimizer may take.

    Attributes:
        kernel: The backend's `Kernel` for the optimizer's `update_kernel`,
            or None (then `update_step` runs per variable).
        folds_keep: Whether a gated step passes `keep` down to the kernels
            instead of running under `ops.cond`.
        takes_grad_scale: Whether the gradients may reach the kernel still
            multiplied by a loss scale, which it divides out as it reads them.
        folds_weight_decay: Whether the kernel decays the variables itself.
    """

    kernel: Kernel | None
    folds_keep: bool
    takes_grad_scale: bool
    folds_weight_decay: bool


def step_plan(
    kernel: Kernel | None,
    variables: Sequence[Any],
    *,
    weight_decay: float | None,
    weight_decay_kernel: Any,
    loss_scale_factor: float | None,
    gradient_accumulation_steps: int | None,
    clips: bool,
    use_ema: bool,
) -> StepPlan:
    """The `StepPlan` of one step over `variables`, from the optimizer's settings.

    `keep` folds only where nothing else in the step writes, and the grad
    scale only where nothing reads the gradients before the kernel.
    """
    if kernel is None:
        return StepPlan(None, False, False, False)
    overwrites = any(v.overwrite_with_gradient for v in variables)
    constrained = any(v.constraint is not None for v in variables)
    return StepPlan(
        kernel=kernel,
        folds_keep=(
            kernel.folds_keep
            and (weight_decay is None or weight_decay_kernel is not None)
            and not gradient_accumulation_steps
            and not use_ema
            and not overwrites
            and not constrained
        ),
        takes_grad_scale=(
            kernel.takes_grad_scale
            and loss_scale_factor is None
            and not gradient_accumulation_steps
            and not clips
            and not overwrites
        ),
        folds_weight_decay=kernel.folds_weight_decay,
    )
