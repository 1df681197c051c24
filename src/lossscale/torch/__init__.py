"""What torch users plug in: lossscale behind torch's own interfaces.

- `GradScaler`: a `torch.amp.GradScaler` (torch's API and defaults) whose
  scale update is lossscale's state machine, with its extras.
- `Optimizer`: a `torch.optim.Optimizer` running any lossscale optimizer, for
  torch's schedulers, scalers, Lightning and Accelerate.
- `TorchOptimizer`: a `torch.optim.Optimizer` as a lossscale optimizer (the
  inner optimizer of a `LossScaleOptimizer`, say).
- `AppliedStepScheduler`: a torch LR scheduler that skipped steps do not move.
- `watch`: hooks that record, on the device, the module each overflow
  started in, for `summary()["overflows"]` of a scaler or optimizer.
- `clip_grad_norm_`: clipping of the unscaled gradients through the scaler
  that steps the optimizer (Accelerate's clips scaled ones off its fp16 path).

Importing this package imports torch; `import lossscale` does not import it.
It first checks the private parts of torch that `GradScaler` overrides
(`internals`), and raises `ImportError` on a torch whose internals differ.
"""

from lossscale.torch import internals

internals.check()

from lossscale.torch.clipping import clip_grad_norm_  # noqa: E402
from lossscale.torch.grad_scaler import GradScaler  # noqa: E402
from lossscale.torch.native import TorchOptimizer  # noqa: E402
from lossscale.torch.optimizer import Optimizer  # noqa: E402
from lossscale.torch.schedulers import AppliedStepScheduler  # noqa: E402
from lossscale.torch.watch_hooks import Watch, watch  # noqa: E402

__all__ = [
    "AppliedStepScheduler",
    "GradScaler",
    "Optimizer",
    "TorchOptimizer",
    "Watch",
    "clip_grad_norm_",
    "watch",
]
