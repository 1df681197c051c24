"""Type aliases used in lossscale's signatures.

Arrays of any framework are typed loosely (`Array` is `Any`): the aliases
say what a parameter means. Nothing here imports torch, JAX or TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

Array: TypeAlias = Any
"""A NumPy, torch, JAX or TensorFlow array (`numpy.ndarray`, `torch.Tensor`,
`jax.Array`, `tf.Tensor`), or a Python number where a scalar is accepted."""

Shape: TypeAlias = Sequence[int]
"""A shape: a tuple (or other sequence) of non-negative ints."""

Initializer: TypeAlias = str | float | Callable[[tuple[int, ...], str], Array] | Array
"""`"zeros"`, `"ones"`, `"random_normal"`, `"random_uniform"`, a number, a
callable `(shape, dtype) -> array`, or an array."""

Config: TypeAlias = dict[str, Any]
"""A config: plain Python values by argument name (JSON-serializable for the
built-in classes)."""

PyTree: TypeAlias = Any
"""A pytree: nested dicts, lists and tuples (or any registered JAX pytree node)
with arrays as leaves."""

# Imported last, at run time (for `typing.get_type_hints`): the schedules import the above.
from lossscale.schedules.base import LearningRateSchedule  # noqa: E402

LearningRate: TypeAlias = float | LearningRateSchedule | Callable[[], float | Array]
"""A float, a `LearningRateSchedule`, or a callable taking no arguments and
returning the learning rate."""

__all__ = ["Array", "Config", "Initializer", "LearningRate", "PyTree", "Shape"]
