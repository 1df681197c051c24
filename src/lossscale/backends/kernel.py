"""The kernel contract: what a backend's update kernel takes, and what it can do.

An optimizer class names its kernel (`Optimizer.update_kernel = "adam"`) and
declares the slot lists (`kernel_slots`) it keeps; each backend's
`fused_update(name)` returns a `Kernel`, or None (then `update_step` runs
per variable). The optimizer calls it with everything it reads and writes:

```
kernel(params, grads, slots, hyper, *, iterations, lr, rule, keep=None, grad_scale=None,
       found_inf=None, weight_decay=None)
```

- `params`: the `Variable`s of this step; `grads`: their gradients, aligned.
- `slots`: `{slot name: [Variable, ...]}`, each list aligned with `params`.
- `hyper`: the optimizer's hyperparameters, a frozen named tuple
  (`hyper.beta_1`, ...).
- `iterations`: the optimizer's step count before this step; `lr`: the
  learning rate (a number or a backend scalar).
- `rule`: the per-variable reference, `rule(grad, variable, lr)` (the
  optimizer's `update_step`), for the variables a kernel leaves to it.
- `keep`: None, or a boolean scalar of the backend: the step's writes take
  effect only where it holds (a kernel with `folds_keep` gets one; nothing
  reads it on the host).
- `grad_scale`: None, or a loss scale still multiplied into `grads`, which a
  kernel with `takes_grad_scale` divides out as it reads them.
- `found_inf`: None, or `keep` in torch's AMP form (a float32 0-d flag, 1.0
  where the step is skipped) where the caller's check made it: a kernel
  with `takes_found_inf` hands it to torch's fused kernels instead of making
  it again from `keep`. Given only together with `keep`, and only to such
  a kernel.

A kernel reads no attribute of an optimizer: the arguments are the whole
contract. Each registered kernel has a test proving it equals `update_step`.

A weight-decay kernel (`fused_weight_decay()`) is
`decay(params, weight_decay, lr, keep=None)`: `v -= v * weight_decay * lr`
for every variable, bit for bit, taking effect only where `keep` holds.
"""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A registered update kernel and its capabilities.

    Attributes:
        fn: The kernel (see the module doc for its arguments).
        folds_keep: Whether it honours `keep` itself (in its arithmetic or
            its writes), so a gated step needs no `ops.cond`.
        takes_grad_scale: Whether it accepts `grad_scale`.
        takes_found_inf: Whether it accepts `found_inf`.
        folds_weight_decay: Whether it accepts `weight_decay` (and decays
            the parameters itself, as `fused_weight_decay()` would).
    """

    fn: Callable
    folds_keep: bool = False
    takes_grad_scale: bool = False
    takes_found_inf: bool = False
    folds_weight_decay: bool = False

    def __call__(self, params, grads, slots, hyper, **kwargs):
        return self.fn(params, grads, slots, hyper, **kwargs)
