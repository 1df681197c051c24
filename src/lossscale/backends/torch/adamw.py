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
is not (the Adam kernel is given `alpha` as its rate, see `fused.adam`).
Where `alpha` is known on the host (`host.adam_step_size`: float32
parameters on the CPU), `folded_rate` finds the kernel a `weight_decay`
under which its factor is Keras's, checked on every step, and the decay
costs no pass of its own. Elsewhere (a GPU, half precision, an inexact
fold, a learning rate given as a number) the decay is its own kernel
before the fused Adam update (`decay`), one pass over the parameters in
place, no new tensors.

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

import math

import torch

from lossscale.backends.torch import host, ops, plans


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
        factor = step_factor(weight_decay, learning_rate, cache, keep)
        for group in plans.plan(params, {}, cache, purpose="weight_decay").groups:
            decay(group, factor)


def step_factor(weight_decay, learning_rate, cache, keep=None):
    """This step's `decay_factor` (kept while the rate is unchanged); 1.0 where not `keep`."""
    factor = _cached_factor(weight_decay, ops.unwrap(learning_rate), cache)
    if keep is None:
        return factor
    writer = plans.Writer(keep, ops.unwrap(keep).device)
    if not isinstance(factor, torch.Tensor):
        factor = ops.constant(factor, torch.float32, ops.unwrap(keep).device)
    one = ops.constant(1.0, factor.dtype, factor.device)
    return torch.where(writer.keep, factor, one)


def decay(group, factor):
    """`v *= factor` for every parameter of one `plans.Group`, in one kernel."""
    if isinstance(factor, torch.Tensor) and factor.device != group.device:
        factor = factor.to(group.device)
    torch._foreach_mul_(group.params, factor)


def folded_rate(weight_decay, learning_rate, alpha, cache):
    """The rate under which `torch._fused_adamw_`, given `alpha`, decays as Keras; else None.

    torch's CPU kernel multiplies each float32 parameter by
    `float(1 - lr * weight_decay)`, computed in double, then applies Adam
    with `lr` as its step size. With `lr = alpha`, the rate returned is
    `(1 - f) / alpha` rounded to float32, where `f` is Keras's float32
    factor `1 - weight_decay * learning_rate`: a float32 times a float32 is
    exact in double, so the kernel's `1 - lr * weight_decay` is rounded once,
    whether or not its compiler fuses the multiply and subtract. The factor
    that gives is checked against `f` here, at every call (as `alpha`
    changes every step); where it differs the caller decays on its own.

    Args:
        weight_decay: Python float, the decay rate.
        learning_rate: The step's learning rate: only a float32 0-d tensor on
            a `HOST_READABLE` device is folded (Keras's factor is then a
            float32 tensor); for anything else None is returned.
        alpha: The host's Adam step size (`host.adam_step_size`), or None.
        cache: The optimizer's kernel cache (the factor, read on the host
            once per learning-rate tensor).

    Returns:
        A Python float >= 0, or None.
    """
    lr = ops.unwrap(learning_rate)
    if (
        alpha is None
        or not alpha > 0.0
        or not isinstance(lr, torch.Tensor)
        or lr.dtype != torch.float32
        or lr.ndim != 0
        or not host.readable(lr)
    ):
        return None
    factor = plans.derived(
        cache,
        ("torch host decay factor", weight_decay),
        lr,
        lambda lr: float(_cached_factor(weight_decay, lr, cache)),
    )
    rate = host.float32((1.0 - factor) / alpha)
    if not 0.0 <= rate < math.inf or host.float32(1.0 - alpha * rate) != factor:
        return None
    return rate


def _cached_factor(weight_decay, learning_rate, cache):
    """`decay_factor`, made again only when the learning-rate tensor or its value changed."""
    return plans.derived(
        cache,
        ("torch decay factor", weight_decay),
        learning_rate,
        lambda lr: decay_factor(weight_decay, lr),
    )
