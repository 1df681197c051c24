"""What a step may ask of its kernel: the one place that decides the fast paths.

```
kernel             = ops.fused_update(update_kernel)       # the backend's entry, or None
folds_keep         = kernel honours `keep`, weight decay has a kernel, and nothing
                     else in the step writes (accumulation, EMA, constraints,
                     overwrite-with-gradient variables)
takes_grad_scale   = kernel divides a scale out as it reads the gradients, and
                     nothing reads them before it (clipping, accumulation, a
                     static loss-scale factor, overwrite-with-gradient variables)
folds_weight_decay = kernel decays the variables itself
```

`Optimizer._step` reads the plan to pass `keep` down or gate the step
under `ops.cond`; `LossScaleOptimizer` and `lossscale.torch.Optimizer` read
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
    """The `StepPlan` of one step (see the module docstring).

    Args:
        kernel: The backend's kernel for the optimizer's rule, or None.
        variables: The `Variable`s this step updates.
        weight_decay: The optimizer's `weight_decay` (None: no decay).
        weight_decay_kernel: The backend's `fused_weight_decay()`, or None.
        loss_scale_factor: The optimizer's static `loss_scale_factor`.
        gradient_accumulation_steps: The optimizer's setting.
        clips: Whether `clipnorm`, `clipvalue` or `global_clipnorm` is set.
        use_ema: The optimizer's setting.
    """
    if kernel is None:
        return StepPlan(None, False, False, False)
    overwrites = constrained = False
    for v in variables:
        overwrites = overwrites or v.overwrite_with_gradient
        constrained = constrained or v.constraint is not None
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
