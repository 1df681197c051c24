"""The JAX backend's kernel registry: fused update rules by name (see `backends.kernel`)."""

from lossscale.backends.jax import float16_range, fused
from lossscale.backends.kernel import Kernel

KERNELS = {
    "adam": Kernel(fused.adam, folds_keep=True, takes_grad_scale=True),
    "sgd": Kernel(fused.sgd, folds_keep=True, takes_grad_scale=True),
}


def fused_update(name):
    """The `Kernel` named `name`, or None."""
    return KERNELS.get(name)


def fused_weight_decay():
    """Decoupled weight decay with a skip folded into it (see `fused.weight_decay`)."""
    return fused.weight_decay


def fused_scale_update():
    """None: the generic selects of `next_loss_scale` are this backend's path (scalars)."""
    return None


def fused_float16_range():
    """Many gradients' float16 range, one fused pass each (see `float16_range`)."""
    return float16_range.measure
