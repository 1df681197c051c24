"""AdamW's decoupled weight decay on torch, as Keras 3's torch backend does it.

Keras's decoupled weight decay is rounded differently on each backend. Its
generic rule (NumPy, JAX, TensorFlow) is `v - v * wd * lr`; its torch
backend (`TorchOptimizer._apply_weight_decay`, used by every optimizer
there) multiplies every decayed variable by one factor, `1 - wd * lr`,
computed as a 0-d tensor in the learning rate's dtype, in one multi-tensor
product. On torch, lossscale follows Keras-on-torch: the same factor,
rounded the same way (`wd * lr`, then `1 - ...`, each rounded to the
learning rate's dtype), and one `torch._foreach_mul_` per (device, dtype)
group, the factor given as that 0-d tensor, so that half-precision
parameters are multiplied by the float32 factor as Keras's are.

That one multiplication by `1 - lr * wd` is also what torch's
`_fused_adamw_` does, but inside the kernel it ties `lr` to the Adam step
size, which Keras's `alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)`
is not (the Adam kernel is given `alpha` as its rate, see `fused.adam`):
the decay is therefore its own kernel before the fused Adam update, one
pass over the parameters in place, no new tensors.

Under a loss-scale wrapper's `keep` flag the factor is `1.0` where the step
is skipped, and `v * 1.0` is `v` bit for bit (-0.0, inf and NaN included):
no select of the parameters.

The factor depends on the learning rate alone, which moves only when a
schedule or a user sets it: it is kept in the optimizer's kernel cache with
the learning-rate tensor it was made from and that tensor's version counter
(which every in-place write advances), and made again when either changed.
A step then costs the multiplication, and under `keep` one select of the
factor.
"""

import torch

from lossscale.backends.torch import ops, plans


def decay_factor(weight_decay, learning_rate):
    """Keras-on-torch's `1 - weight_decay * learning_rate`.

    A tensor learning rate gives a 0-d tensor of its dtype (each operation
    rounded there, as Keras's); a Python number gives a Python number.
    """
    return 1 - weight_decay * learning_rate


def weight_decay(params, weight_decay, learning_rate, *, cache, keep=None):
    """`v *= 1 - weight_decay * learning_rate` for every variable, one kernel per group.

    Args:
        params: The `Variable`s to decay (exclusions already applied).
        weight_decay: Python float, the decay rate.
        learning_rate: The step's learning rate (a 0-d tensor, or a number).
        cache: The optimizer's kernel cache (the groups' tensor lists, the
            last factor).
        keep: None, or a boolean scalar: where it is False the factor is 1.0.
    """
    with torch.no_grad():
        factor = _cached_factor(weight_decay, ops.unwrap(learning_rate), cache)
        if keep is not None:
            writer = plans.Writer(keep, ops.unwrap(keep).device)
            if not isinstance(factor, torch.Tensor):
                factor = ops.constant(factor, torch.float32, ops.unwrap(keep).device)
            one = ops.constant(1.0, factor.dtype, factor.device)
            factor = torch.where(writer.keep, factor, one)
        for group in plans.plan(params, {}, cache, purpose="weight_decay").groups:
            on_device = factor
            if isinstance(factor, torch.Tensor) and factor.device != group.device:
                on_device = factor.to(group.device)
            torch._foreach_mul_(group.params, on_device)


def _cached_factor(weight_decay, learning_rate, cache):
    """`decay_factor`, made again only when the learning-rate tensor or its value changed."""
    return plans.derived(
        cache,
        ("torch decay factor", weight_decay),
        learning_rate,
        lambda lr: decay_factor(weight_decay, lr),
    )
