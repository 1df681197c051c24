"""The kernel contract: what a backend's update kernel takes, and what it can do.

An optimizer class names its kernel (`Optimizer.update_kernel = "adam"`) and
its slot lists (`kernel_slots`); a backend's `fused_update(name)` returns a
`Kernel`, or None (then `update_step` runs per variable). It is called with
everything it reads and writes, and reads no attribute of an optimizer:

```
kernel(params, grads, slots, hyper, *, iterations, lr, rule, keep=None, grad_scale=None,
       found_inf=None, weight_decay=None)
```

- `params`: the `Variable`s of this step; `grads`: their gradients, aligned.
- `slots`: `{slot name: [Variable, ...]}`, each list aligned with `params`.
- `hyper`: the hyperparameters, a frozen named tuple (`hyper.beta_1`, ...).
- `iterations`: the step count before this step; `lr`: the learning rate.
- `rule`: `rule(grad, variable, lr)` (the optimizer's `update_step`), for the
  variables a kernel leaves to it.
- `keep`: None, or a boolean scalar: the step's writes take effect only
  where it holds (only for `folds_keep`; never read on the host).
- `grad_scale`: None, or a loss scale still in `grads`, divided out as they
  are read (only for `takes_grad_scale`).
- `found_inf`: None, or `keep` in torch's AMP form (float32, 1.0 where
  skipped) where the caller made it; only with `keep`, for `takes_found_inf`.

Each registered kernel has a test proving it equals `update_step`.
"""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A registered update kernel and its capabilities.

    Attributes:
        fn: The kernel (see the module doc for its arguments).
        folds_keep: Whether it honours `keep` itself (a gated step needs no `ops.cond`).
        takes_grad_scale: Whether it accepts `grad_scale`.
        takes_found_inf: Whether it accepts `found_inf`.
        folds_weight_decay: Whether it accepts `weight_decay` and decays itself.
    """

    fn: Callable
    folds_keep: bool = False
    takes_grad_scale: bool = False
    takes_found_inf: bool = False
    folds_weight_decay: bool = False

    def __call__(self, params, grads, slots, hyper, **kwargs):
        return self.fn(params, grads, slots, hyper, **kwargs)
