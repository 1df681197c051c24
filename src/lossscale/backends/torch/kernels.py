"""The torch backend's kernel registry: multi-tensor update rules by name (see `backends.kernel`).

Adam, AdamW and SGD run on torch's fused kernels (`fused`), the others on
`torch._foreach_*` rules (`foreach`).
"""

from lossscale.backends.kernel import Kernel
from lossscale.backends.torch import adamw, float16_range, foreach, fused, scale_update

# Every kernel honours `keep` itself: torch's fused kernels as `found_inf`,
# the others in `plans.Writer`'s selects.
KERNELS = {
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
