"""`lossscale demo`: a real float16 training run that shows why loss scaling matters.

A small ReLU network learns scikit-learn's 8x8 digits four times with the
same seed, weights and batches, all with Adam: in float32; in float16
without loss scaling; in float16 with `LossScaleOptimizer`, with the
`"fixed"` and the `"statistics"` growth policies (see docs/demo.md).

- Float16 parameters with a float32 master copy, not autocast (CPU autocast
  is bfloat16, whose range hides the underflow shown here).
- Underflow is measured: the share of values nonzero in the float32
  gradients at the same weights and batch but zero in float16.
- Every run multiplies its loss (and Adam's `epsilon`) by `loss_weight`
  (2^-16; `--loss-weight`), standing in for a large model's averaging over
  many terms; a power of two leaves the float32 run exactly unchanged.

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
