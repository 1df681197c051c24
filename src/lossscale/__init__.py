"""lossscale: dynamic loss scaling for mixed-precision training.

Works on NumPy, PyTorch and JAX arrays; the backend comes from the arrays.
Importing this package imports neither torch nor jax.
"""

from lossscale import mixed_precision, optimizers, pytree, saving, schedules
from lossscale.mixed_precision import LossScaleError
from lossscale.optimizers import LossScaleOptimizer
from lossscale.variables import Variable

__version__ = "0.1.0"

__all__ = [
    "LossScaleError",
    "LossScaleOptimizer",
    "Variable",
    "mixed_precision",
    "optimizers",
    "pytree",
    "saving",
    "schedules",
]
