"""The TensorFlow backend's kernel registry: fused update rules by name.

An optimizer class names the kernel that reproduces its `update_step`
(`Optimizer.update_kernel`); `fused_update(name)` returns that kernel, or
None, in which case the per-variable `update_step` runs.
"""

KERNELS = {}


def fused_update(name):
    """The kernel `(optimizer, grads, variables, learning_rate)` named `name`, or None."""
    return KERNELS.get(name)


def fused_weight_decay():
    """None: `weight_decay.apply_weight_decay` decays one variable at a time."""
    return None


def fused_scale_update():
    """None: the generic selects of `next_loss_scale` are this backend's path."""
    return None
