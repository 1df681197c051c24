"""What torch users plug in: lossscale behind torch's own interfaces.

- `GradScaler`: a `torch.amp.GradScaler` (torch's API and defaults) whose
  scale update is lossscale's state machine, with its extras.

Importing this package imports torch; `import lossscale` does not import it.
"""

from lossscale.torch.grad_scaler import GradScaler

__all__ = ["GradScaler"]
