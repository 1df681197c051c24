"""The NumPy backend's kernel registry: fused update rules by name (see `backends.kernel`)."""

from lossscale.backends.kernel import Kernel
from lossscale.backends.numpy import fused

# A skipped step never reaches them: `cond` on a NumPy flag is an `if`.
KERNELS = {
    "adam": Kernel(fused.adam, takes_grad_scale=True),
    "sgd": Kernel(fused.sgd, takes_grad_scale=True),
}


def fused_update(name):
    """The `Kernel` named `name`, or None."""
    return KERNELS.get(name)


def fused_weight_decay():
    """None: `weight_decay.apply_weight_decay` decays one variable at a time."""
    return None


def fused_scale_update():
    """None: the generic selects of `next_loss_scale` are this backend's path."""
    return None


def fused_float16_range():
    """None: `diagnostics.measure` measures one gradient at a time here."""
    return None
