"""Native optimizers in lossscale wrappers: `wrap_native`.

It gives a torch or optax optimizer its adapter (from `lossscale.adapters`,
where the adapter packages register themselves).
"""

from __future__ import annotations

from typing import Any

from lossscale import adapters


def wrap_native(optimizer: Any) -> Any:
    """Returns `optimizer` wrapped in its adapter, or unchanged if it needs none.

    A `torch.optim.Optimizer` becomes a `TorchAdapter` and an
    `optax.GradientTransformation` an `OptaxAdapter` (the adapters their
    packages register in `lossscale.adapters`); anything else (a lossscale
    optimizer, or a value the caller will reject) is returned as it is.
    Only the adapter packages of libraries already loaded are imported.

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
