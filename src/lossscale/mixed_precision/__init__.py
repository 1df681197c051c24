"""Mixed-precision tools: the loss-scale wrapper, its state machine and telemetry."""

from lossscale.mixed_precision.loss_scale import LossScalePolicy, LossScaleState, next_loss_scale
from lossscale.mixed_precision.telemetry import (
    LossScaleError,
    PersistentSkipWarning,
    ScaleMismatchWarning,
    UnscaledLossWarning,
)

__all__ = [
    "LossScaleError",
    "LossScaleOptimizer",
    "LossScalePolicy",
    "LossScaleState",
    "PersistentSkipWarning",
    "ScaleMismatchWarning",
    "UnscaledLossWarning",
    "next_loss_scale",
]


def __getattr__(name):
    # `LossScaleOptimizer` lives in `optimizers/`, which imports this
    # package's modules: read on first use, so no import cycle joins them.
    if name == "LossScaleOptimizer":
        from lossscale.optimizers.loss_scale_optimizer import LossScaleOptimizer

        return LossScaleOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
