"""A traced step's unscale and finite check on the CPU: one opaque operation.

While `torch.compile` traces a step, the multi-tensor unscale and check
(`multi.unscale_checked`) became loops Inductor wrote itself: unscaled
copies of every gradient, a packed copy of the small ones and a parallel
region per reduction, about a third of the compiled step on a small
model. Where the eager step divides the gradients in place (float32 or
float64 on a `HOST_READABLE` device, outside an autograd graph), the traced
step calls `lossscale::unscale_checked_` instead: an operation the compiler
leaves alone, which runs what the eager step runs (one AMP pass where the
scale allows, `multi.unscale_checked`), so the compiled step unscales and
checks bit for bit as the eager one does.
"""

import torch

from lossscale.backends._common import unwrap
from lossscale.backends.torch import dtensors, multi

_LIBRARY = torch.library.Library("lossscale", "FRAGMENT")
# The schema names the gradients it divides in place; it returns the skip
# flag in torch's AMP form (float32, 1.0 where a value is inf or NaN).
_LIBRARY.define("unscale_checked_(Tensor(a!)[] grads, Tensor scale) -> Tensor")


def _unscale_checked_eager(grads, scale):
    # Each tensor once: the list may hold one twice, which the eager rule
    # would divide into copies rather than twice in place.
    distinct = list({id(g): g for g in grads}.values())
    with torch.no_grad():
        _, _, skip = multi.unscale_checked(distinct, scale, in_place=True)
    return skip


_LIBRARY.impl("unscale_checked_", _unscale_checked_eager, "CPU")
torch.library.register_fake(
    "lossscale::unscale_checked_", lambda grads, scale: scale.new_empty(()), lib=_LIBRARY
)
_traced = torch.ops.lossscale.unscale_checked_.default


def unscale_checked(grads, scale, in_place=False):
    """`multi.unscale_checked`, as one opaque call where a traced step divides in place.

    Returns `(unscaled, finite, skip)`.
    """
    grads, scale = [unwrap(g) for g in grads], unwrap(scale)
    if in_place and _opaque(grads, scale):
        skip = _traced(grads, scale)
        return grads, skip == 0, skip
    return multi.unscale_checked(grads, scale, in_place)


def _opaque(grads, scale):
    """Whether a traced step unscales `grads` with `lossscale::unscale_checked_`.

    While `torch.compile` traces: on one `HOST_READABLE` device, float32 or
    float64 gradients outside an autograd graph (not DTensors), a 0-d
    float32 scale there. Whether a tensor takes part in an autograd graph
    is part of what the compiler guards on each input.
    """
    if not grads or not torch.compiler.is_compiling() or not isinstance(scale, torch.Tensor):
        return False
    device, dtype = grads[0].device, grads[0].dtype
    return (
        device.type in multi.HOST_READABLE
        and dtype in (torch.float32, torch.float64)
        and scale.ndim == 0
        and scale.dtype == torch.float32
        and scale.device == device
        and all(g.device == device and g.dtype == dtype and not g.requires_grad for g in grads)
        and not dtensors.is_dtensor(grads[0])
    )
