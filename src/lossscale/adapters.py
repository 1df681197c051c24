"""Adapters that make native optimizers lossscale optimizers, registered by their packages.

`lossscale.torch` adapts `torch.optim.Optimizer`s (`TorchAdapter`) and
`lossscale.optax` optax transformations (`OptaxAdapter`); each registers
its adapter here (`register`) when it is imported. `adapt` (behind
`lossscale.optimizers.native.wrap_native`) asks the registered adapters,
first importing the adapter package of each library that is already
loaded: an object can only be a torch optimizer (or an optax
transformation) if its library is loaded, so no other library is ever
imported. The optimizer layer itself names no adapter package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

# Library -> the module of the adapter that registers itself for it.
ADAPTER_MODULES = {"torch": "lossscale.torch.adapter", "optax": "lossscale.optax.adapter"}

# (`accepts(optimizer)`, `make(optimizer)`) pairs, in registration order.
_ADAPTERS: list[tuple[Callable[[Any], bool], Callable[[Any], Any]]] = []


def register(accepts: Callable[[Any], bool], make: Callable[[Any], Any]) -> None:
    """Registers an adapter: `make(optimizer)` for every optimizer `accepts` takes."""
    if not any(a is accepts for a, _ in _ADAPTERS):
        _ADAPTERS.append((accepts, make))


def adapt(optimizer: Any) -> Any:
    """`optimizer` in its registered adapter, or unchanged (see `wrap_native`)."""
    for library, module in ADAPTER_MODULES.items():
        if library in sys.modules:
            importlib.import_module(module)  # registers its adapter
    for accepts, make in _ADAPTERS:
        if accepts(optimizer):
            return make(optimizer)
    return optimizer
