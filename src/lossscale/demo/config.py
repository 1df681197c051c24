"""Settings of `lossscale demo`, checked once, before anything runs."""

import dataclasses

from lossscale import validation
from lossscale.demo.models import BACKENDS

DEFAULT_STEPS = 1500
QUICK_STEPS = 300
DEFAULT_LOSS_WEIGHT = 2.0**-16  # see the package docstring
# The default `growth_steps`: both policies get one chance to grow per 50
# steps, so the table compares their decisions, not their cadences.
DEFAULT_DIAGNOSTICS_EVERY = 50


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything one `lossscale demo` run depends on.

    Args:
        steps: Int >= 1. Optimizer steps per run.
        seed: Int >= 0. Seeds the data split, the batch order and the
            initial weights, which the four runs share.
        out: Directory for `demo.png`, `demo_float16_range.png` and
            `results.json` (created if needed).
        initial_scale: Float > 0. `LossScaleOptimizer`'s initial loss scale.
        growth_steps: Int >= 1. `LossScaleOptimizer`'s
            `dynamic_growth_steps` (of the `"fixed"` growth policy).
        diagnostics_every: Int >= 1. The loss-scaled runs'
            `diagnostics_every` (the heatmap's cadence).
        backend: `"torch"`, `"numpy"`, `"jax"` or `"tensorflow"`: the array
            library the model and the optimizer run on.
        loss_weight: Float > 0. The constant every run multiplies its loss
            (and Adam's `epsilon`) by.
        batch_size: Int, 1 to 1437 (the training split's size).
        learning_rate: Float > 0. Adam's learning rate.
        hidden_units: Int >= 1. Width of the hidden layer.
        progress: Boolean. Whether to show a progress bar per run.

    Examples:
        >>> from lossscale.demo import DemoConfig
        >>> DemoConfig(steps=50, backend="numpy").growth_steps
        50
    """

    steps: int = DEFAULT_STEPS
    seed: int = 0
    out: str = "lossscale-demo"
    initial_scale: float = 2.0**15
    growth_steps: int = 50
    diagnostics_every: int = DEFAULT_DIAGNOSTICS_EVERY
    backend: str = "torch"
    loss_weight: float = DEFAULT_LOSS_WEIGHT
    batch_size: int = 128
    learning_rate: float = 3e-3
    hidden_units: int = 128
    progress: bool = True

    def __post_init__(self):
        check = validation.check_number
        check("steps", self.steps, low=1, integer=True)
        check("seed", self.seed, low=0, integer=True)
        if not isinstance(self.out, str) or not self.out:
            raise ValueError(f"`out` must be a non-empty path string. Received: out={self.out!r}")
        check("initial_scale", self.initial_scale, low=0, low_open=True)
        check("growth_steps", self.growth_steps, low=1, integer=True)
        check("diagnostics_every", self.diagnostics_every, low=1, integer=True)
        validation.check_choice("backend", self.backend, BACKENDS)
        check("loss_weight", self.loss_weight, low=0, low_open=True)
        check("batch_size", self.batch_size, low=1, high=1437, integer=True)
        check("learning_rate", self.learning_rate, low=0, low_open=True)
        check("hidden_units", self.hidden_units, low=1, integer=True)
        validation.check_bool("progress", self.progress)
