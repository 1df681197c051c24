"""`OptimizerState`: an optimizer's variable values as a named, read-only pytree."""

from __future__ import annotations

import collections.abc
import sys
from collections.abc import Iterator, Mapping

from lossscale.typing import Array


class OptimizerState(collections.abc.Mapping):
    """The values of an optimizer's `variables`, keyed by readable names.

    A read-only mapping and a JAX pytree whose leaves are the arrays in
    sorted-name order, with the names as static structure: a state rebuilt
    from a checkpoint does not retrace a jitted step.

    Args:
        values: A mapping from names to arrays.

    Examples:
        >>> import numpy as np
        >>> from lossscale.pytree import OptimizerState
        >>> state = OptimizerState({"sgd/iteration": np.array(3)})
        >>> int(state["sgd/iteration"]), list(state)
        (3, ['sgd/iteration'])
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Array]) -> None:
        if not isinstance(values, collections.abc.Mapping):
            raise TypeError(
                "`values` must be a mapping from names to arrays. "
                f"Received: values of type {type(values).__name__}"
            )
        for name in values:
            if not isinstance(name, str):
                raise TypeError(f"`values` keys must be strings. Received: key {name!r}")
        _register_with_jax()
        self._values = {name: values[name] for name in sorted(values)}

    def __getitem__(self, name: str) -> Array:
        try:
            return self._values[name]
        except KeyError:
            raise KeyError(
                f"No optimizer variable named {name!r}. Known: {list(self._values)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def replace(self, **updates: Array) -> OptimizerState:
        """Returns a copy with some values replaced (names must exist): `replace(**{name: x})`."""
        for name in updates:
            self[name]  # raises a KeyError naming the known variables
        return OptimizerState({**self._values, **updates})

    def __repr__(self):
        def describe(x):
            shape = tuple(getattr(x, "shape", ()))
            dtype = getattr(x, "dtype", None)
            # torch's dtypes have no name and print as "torch.float32".
            dtype = getattr(dtype, "name", None) or str(dtype or type(x).__name__)
            dtype = dtype.removeprefix("torch.")
            return f"{dtype}{list(shape)}"

        inner = ", ".join(f"{name!r}: {describe(x)}" for name, x in self._values.items())
        return f"OptimizerState({{{inner}}})"


_registered = False


def _register_with_jax():
    """Registers `OptimizerState` with JAX once imported (importing lossscale imports no JAX)."""
    global _registered
    jax = sys.modules.get("jax")
    if _registered or jax is None:
        return
    tree_util = jax.tree_util

    def flatten_with_keys(state):
        names = tuple(state._values)
        return [(tree_util.DictKey(n), state._values[n]) for n in names], names

    def unflatten(names, leaves):
        state = object.__new__(OptimizerState)
        state._values = dict(zip(names, leaves))
        return state

    tree_util.register_pytree_with_keys(
        OptimizerState,
        flatten_with_keys,
        unflatten,
        flatten_func=lambda state: (tuple(state._values.values()), tuple(state._values)),
    )
    _registered = True
