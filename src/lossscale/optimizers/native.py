"""`wrap_native`: a torch or optax optimizer in its lossscale adapter."""

from __future__ import annotations

from typing import Any

from lossscale import adapters


def wrap_native(optimizer: Any) -> Any:
    """Returns `optimizer` wrapped in its adapter, or unchanged if it needs none.

    A `torch.optim.Optimizer` becomes a `TorchAdapter` and an
    `optax.GradientTransformation` an `OptaxAdapter`. Only the adapter
    packages of libraries already loaded are imported.

    Args:
        optimizer: Any object.

    Returns:
        A lossscale optimizer for a native one, else `optimizer`.

    Examples:
        >>> import torch
        >>> from lossscale.optimizers.native import wrap_native
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> wrap_native(torch.optim.SGD([w], lr=0.1))
        <TorchAdapter name='torch_optimizer' built=False>
    """
    return adapters.adapt(optimizer)
