"""What torch users plug in: lossscale behind torch's own interfaces.

- `GradScaler`: a `torch.amp.GradScaler` (torch's API and defaults) whose
  scale update is lossscale's state machine, with its extras.
- `Optimizer`: a `torch.optim.Optimizer` running any lossscale optimizer, for
  torch's schedulers, scalers, Lightning and Accelerate.
- `TorchAdapter`: a `torch.optim.Optimizer` adapted into a lossscale
  optimizer (`TorchOptimizer` is an alias).
- `AppliedStepScheduler`: a torch LR scheduler that skipped steps do not move.
- `watch`: hooks that record, on the device, the module each overflow
  started in, for `summary()["overflows"]` of a scaler or optimizer.
- `clip_grad_norm_`: clipping of the unscaled gradients through the scaler.

Importing this package imports torch, and raises `ImportError` where the
private parts of torch that `GradScaler` overrides differ (`internals`).
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

TorchOptimizer = TorchAdapter  # the adapter's earlier name
