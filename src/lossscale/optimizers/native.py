"""`wrap_native`: a framework's own optimizer in the adapter lossscale drives it with.

Neither torch nor optax is imported here: an object can only be a
`torch.optim.Optimizer` (or an `optax.GradientTransformation`) if its
library is already loaded, so only loaded libraries are consulted.
"""

import sys


def wrap_native(optimizer):
    """Returns `optimizer` wrapped in its adapter, or unchanged if it needs none.

    A `torch.optim.Optimizer` becomes a `TorchOptimizer` and an
    `optax.GradientTransformation` an `OptaxOptimizer`; anything else
    (a lossscale optimizer, or a value the caller will reject) is returned
    as it is.

    Args:
        optimizer: Any object.

    Returns:
        A lossscale optimizer for a native one, else `optimizer`.

    Example:

    >>> import torch
    >>> from lossscale.optimizers.native import wrap_native
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> wrap_native(torch.optim.SGD([w], lr=0.1))
    <TorchOptimizer name='torch_optimizer' built=False>
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(optimizer, torch.optim.Optimizer):
        from lossscale.optimizers.torch_native import TorchOptimizer

        return TorchOptimizer(optimizer)
    optax = sys.modules.get("optax")
    if optax is not None and isinstance(optimizer, optax.GradientTransformation):
        from lossscale.optimizers.optax_native import OptaxOptimizer

        return OptaxOptimizer(optimizer)
    return optimizer
