"""Mixed-precision tools: the loss-scale wrapper and its state machine."""

from lossscale.mixed_precision.loss_scale import (LossScalePolicy, LossScaleState,
                                                  next_loss_scale)
from lossscale.optimizers.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["LossScaleOptimizer", "LossScalePolicy", "LossScaleState", "next_loss_scale"]
