"""lossscale: dynamic loss scaling for mixed-precision training.

Works on NumPy, PyTorch, JAX and TensorFlow arrays; the backend comes from
the arrays. Importing this package imports none of torch, jax and
tensorflow.
"""

from lossscale import mixed_precision, optimizers, pytree, saving, schedules
from lossscale.mixed_precision import (
    LossScaleError,
    PersistentSkipWarning,
    ScaleMismatchWarning,
    UnscaledLossWarning,
)
from lossscale.optimizers import LossScaleOptimizer
from lossscale.variables import Variable

__version__ = "0.1.0"

__all__ = [
    "LossScaleError",
    "LossScaleOptimizer",
    "PersistentSkipWarning",
    "ScaleMismatchWarning",
    "UnscaledLossWarning",
    "Variable",
    "mixed_precision",
    "optimizers",
    "pytree",
    "saving",
    "schedules",
]
