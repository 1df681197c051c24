"""What torch users plug in: lossscale behind torch's own interfaces.

- `GradScaler`: a `torch.amp.GradScaler` (torch's API and defaults) whose
  scale update is lossscale's state machine, with its extras.
- `Optimizer`: a `torch.optim.Optimizer` running any lossscale optimizer, for
  torch's schedulers, scalers, Lightning and Accelerate (lossscale -> torch:
  in this package "Optimizer" means torch's kind, as `torch.optim.Optimizer`).
- `TorchAdapter`: the other direction, a `torch.optim.Optimizer` adapted into
  a lossscale optimizer (the inner optimizer of a `LossScaleOptimizer`, say).
  `TorchOptimizer` is its earlier name, kept as an alias.
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

from lossscale.torch.adapter import TorchAdapter  # noqa: E402
from lossscale.torch.clipping import clip_grad_norm_  # noqa: E402
from lossscale.torch.grad_scaler import GradScaler  # noqa: E402
from lossscale.torch.optimizer import Optimizer  # noqa: E402
from lossscale.torch.schedulers import AppliedStepScheduler  # noqa: E402
from lossscale.torch.watch_hooks import Watch, watch  # noqa: E402

__all__ = [
    "AppliedStepScheduler",
    "GradScaler",
    "Optimizer",
    "TorchAdapter",
    "TorchOptimizer",
    "Watch",
    "clip_grad_norm_",
    "watch",
]

# The adapter's name until 0.1.x; kept so that code written for it runs.
TorchOptimizer = TorchAdapter
