"""The torch backend's kernel registry: multi-tensor update rules by name.

An optimizer class names the kernel that reproduces its `update_step`
(`Optimizer.update_kernel`); `fused_update(name)` returns that kernel, or
None when there is none and the per-variable `update_step` runs. Adam,
AdamW and SGD run on torch's fused kernels (`fused`), the others on
`torch._foreach_*` rules (`foreach`). Each entry has a test proving it
equals `update_step` (tests/backends/torch/test_fused.py, tests/backends/torch/test_foreach.py).
Nothing here knows an optimizer class: a kernel gets its state as arguments
(`lossscale.backends.kernel`), and the name, the slot names the class
declares and its hyperparameters' names are the whole contract.
"""

from lossscale.backends.kernel import Kernel
from lossscale.backends.torch import adamw, float16_range, foreach, fused, scale_update

# Every kernel here honours the step's `keep` flag itself: torch's fused
# kernels as `found_inf` (the caller's own, where it has one), the others in
# `plans.Writer`'s selects. Adam and SGD divide a loss scale still in the
# gradients out as they read them (`grad_scale`, see `fused`).
KERNELS = {
    # Adam decays its parameters itself: inside torch's fused AdamW kernel
    # where that is exact (`fused.adam`).
    "adam": Kernel(
        fused.adam,
        folds_keep=True,
        takes_grad_scale=True,
        takes_found_inf=True,
        folds_weight_decay=True,
    ),
    "sgd": Kernel(fused.sgd, folds_keep=True, takes_grad_scale=True, takes_found_inf=True),
    **{
        name: Kernel(foreach.make_kernel(getattr(foreach, name)), folds_keep=True)
        for name in ("rmsprop", "adagrad", "adadelta", "adamax", "nadam", "lion", "ftrl", "lamb")
    },
}


def fused_update(name):
    """The `Kernel` named `name`, or None."""
    return KERNELS.get(name)


def fused_weight_decay():
    """Decoupled weight decay, Keras-on-torch's, one kernel per group (see `adamw`)."""
    return adamw.weight_decay


def fused_scale_update():
    """The plain loss-scale update in torch's `_amp_update_scale_` (`scale_update`)."""
    return scale_update.update_scale


def fused_float16_range():
    """Many gradients' float16 range in a fixed number of operations (see `float16_range`)."""
    return float16_range.measure
