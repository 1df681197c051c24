"""AdamW's decoupled weight decay on torch, as Keras 3's torch backend does it.

Keras-on-torch multiplies every decayed variable by one factor, `1 - wd *
lr`, a 0-d tensor in the learning rate's dtype (its generic rule is
`v - v * wd * lr`). lossscale follows it on torch: the same factor, rounded
the same way, one `torch._foreach_mul_` per group.

torch's `_fused_adamw_` multiplies by `1 - lr * wd` too, but ties `lr` to
the Adam step size. Where `alpha` is known on the host, `folded_rate` finds
a `weight_decay` under which the kernel's factor is Keras's, so the decay
costs no pass of its own; elsewhere it is its own kernel (`decay`).

Under `keep` the factor is `1.0` where the step is skipped (`v * 1.0` is
`v`, bit for bit). The factor is cached with the learning-rate tensor and
its version counter.
"""

import math

import torch

from lossscale.backends.torch import host, ops, plans


def decay_factor(weight_decay, learning_rate):
    """Keras-on-torch's `1 - weight_decay * learning_rate` (in a tensor rate's dtype)."""
    return 1 - weight_decay * learning_rate


def weight_decay(params, weight_decay, learning_rate, *, cache, keep=None):
    """`v *= 1 - weight_decay * learning_rate` for every variable, one kernel per group.

    Where `keep` is False the factor is 1.0.
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

    The rate is `(1 - f) / alpha` in float32, `f` Keras's factor; the kernel's
    factor `1 - alpha * rate` (rounded once: float32 products are exact in
    double) is checked against `f` at every call. Only a float32 0-d learning
    rate on a `HOST_READABLE` device, with `alpha` (`host.adam_step_size`), folds.
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
