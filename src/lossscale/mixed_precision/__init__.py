"""Mixed-precision tools: the loss-scale wrapper, its state machine and telemetry."""

from lossscale.mixed_precision.loss_scale import LossScalePolicy, LossScaleState, next_loss_scale
from lossscale.mixed_precision.telemetry import LossScaleError, UnscaledLossWarning
from lossscale.optimizers.loss_scale_optimizer import LossScaleOptimizer

__all__ = [
    "LossScaleError",
    "LossScaleOptimizer",
    "LossScalePolicy",
    "LossScaleState",
    "UnscaledLossWarning",
    "next_loss_scale",
]
