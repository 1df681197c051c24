"""Gradient clipping that sees the unscaled gradients, whoever steps the scaler.

Training loops that call the scaler for the user do not always unscale
before clipping (Accelerate's `clip_grad_norm_` only on its own float16
path); `clip_grad_norm_` here unscales through the scaler itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    *,
    scaler: torch.amp.GradScaler | None,
    optimizer: torch.optim.Optimizer,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Unscales `optimizer`'s gradients through `scaler`, then clips them by their norm.

    Args:
        parameters: The parameters whose gradients are clipped (as in
            `torch.nn.utils.clip_grad_norm_`).
        max_norm: Float. The largest norm the gradients keep.
        scaler: The `torch.amp.GradScaler` (or `lossscale.torch.GradScaler`)
            that steps `optimizer`; `None` or a disabled scaler: nothing to
            unscale.
        optimizer: The optimizer the scaler steps (an Accelerate prepared
            optimizer is taken as the one it wraps).
        norm_type: The norm's order, as in torch.

    Returns:
        The total norm of the unscaled gradients, before clipping (a tensor).
    """
    if scaler is not None and scaler.is_enabled():
        scaler.unscale_(_stepped_by_scaler(optimizer))
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


def _stepped_by_scaler(optimizer):
    # `AcceleratedOptimizer.step` calls `scaler.step(self.optimizer)`, and the
    # scaler keeps its unscale stage per optimizer object.
    module = sys.modules.get("accelerate.optimizer")
    if module is not None and isinstance(optimizer, module.AcceleratedOptimizer):
        return optimizer.optimizer
    return optimizer
