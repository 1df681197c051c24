"""`lossscale demo`: a real float16 training run that shows why loss scaling matters.

A small ReLU network learns scikit-learn's 8x8 handwritten digits (shipped
inside scikit-learn, so nothing is downloaded) four times, with the same
seed, initial weights and batches: in float32; in float16 without loss
scaling; in float16 with `LossScaleOptimizer`, once with the default
(`"fixed"`) growth policy and once with `growth_policy="statistics"`. All
four use Adam. The loss-scaled runs measure each layer's float16 range
every `diagnostics_every` steps (the second picture, a heatmap).

Choices, and why they keep the comparison honest:

- Float16 parameters with a float32 master copy, not autocast. CPU autocast
  defaults to bfloat16, whose float32-sized exponent range hides the very
  underflow this demo is about. The float16 runs instead copy the float32
  master weights into float16 before each step, run the forward and backward
  passes there (so activations and gradients are float16), and hand the
  float16 gradients to the optimizer, which updates the float32 master
  weights: the recipe of Micikevicius et al., "Mixed Precision Training"
  (2018). The runs differ only in the gradients' precision and scaling. The
  same recipe runs on every backend (torch, NumPy with a hand-differentiated
  network, JAX with `jax.grad`, TensorFlow with `tf.GradientTape`).
- Underflow is measured, not assumed. At every step of a float16 run the
  float32 gradients at the same weights and batch are computed too, and the
  table reports the share of values that are nonzero in float32 but zero in
  the float16 gradients the optimizer received.
- The gradient regime is set by one documented constant. Large models
  often average their loss over 10^5-10^6 terms (tokens times batch) and
  backpropagate through many layers, and a large share of their gradient
  values can lie below float16's smallest normal number, 2^-14 (Micikevicius
  et al. show it for the activation gradients of a Multibox SSD detector).
  A 64-128-10 network on 1,437 images averaged over a batch of 128 does not
  get there by itself (the demo measures this: see `--loss-weight 1`), so
  every run multiplies its loss by
  `loss_weight` (2^-16 by default; `--loss-weight`). Adam's `epsilon` is
  multiplied by the same constant, which makes the float32 run identical to
  training on the plain loss: a power-of-two weight scales every gradient
  and both Adam moments exactly. The header the demo prints says all this,
  and `--loss-weight 1` shows the regime where loss scaling is not needed.

Examples:
    >>> import io, os, tempfile
    >>> from lossscale.demo import DemoConfig, run_demo
    >>> config = DemoConfig(steps=20, backend="numpy", out=tempfile.mkdtemp(), progress=False)
    >>> result = run_demo(config, stream=io.StringIO())
    >>> [r.spec.growth_policy for r in result.runs if r.spec.loss_scaling]
    ['fixed', 'statistics']
    >>> os.path.basename(result.heatmap_path), result.runs[1].flushed > 0
    ('demo_float16_range.png', True)
"""

from lossscale.demo.config import DemoConfig
from lossscale.demo.run import DemoResult, MissingDependencyError, run_demo

__all__ = ["DemoConfig", "DemoResult", "MissingDependencyError", "run_demo"]
