"""Backend discovery: the backend comes from the arrays, never from a switch.

torch, jax and tensorflow are imported only when an array of theirs is seen,
so `import lossscale` pulls in none of them.
"""

import importlib
import sys

import numpy as np

from lossscale.backends._common import unwrap

BACKENDS = ("numpy", "torch", "jax", "tensorflow")


def backend_of(x):
    """Returns `"numpy"`, `"torch"`, `"jax"` or `"tensorflow"` for a native array or Variable.

    A Keras 3 `keras.Variable` counts as its value's backend; Python and
    NumPy scalars count as NumPy. Raises `TypeError` for anything else.
    """
    if getattr(x, "_is_lossscale_variable", False):
        return x.backend
    if isinstance(x, (np.ndarray, np.generic, int, float, bool)):
        return "numpy"
    # getattr: a module named keras need not be Keras (a namespace package).
    keras_variable = getattr(sys.modules.get("keras"), "Variable", None)
    if keras_variable is not None and isinstance(x, keras_variable):
        return backend_of(x.value)
    # An array of a library that was never imported cannot exist.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        return "jax"
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(x, (tf.Tensor, tf.Variable)):
        return "tensorflow"
    raise TypeError(
        "Expected a NumPy array, a torch.Tensor, a jax.Array, a tf.Tensor, a tf.Variable "
        f"or a lossscale.Variable. Received: {type(x).__name__}"
    )


def get_ops(name):
    """Returns the backend module for `name` (one of `BACKENDS`)."""
    if name not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}. Received: backend={name!r}")
    return importlib.import_module(f"lossscale.backends.{name}")


def common_backend(arrays, what="arrays"):
    """Returns the one backend name shared by `arrays` (None and Python scalars ignored)."""
    found = None
    for a in arrays:
        if a is None or isinstance(a, (int, float, bool)):
            continue
        name = backend_of(a)
        if found is None:
            found = name
        elif name != found:
            raise ValueError(
                f"All {what} must come from one backend; found both {found!r} "
                f"and {name!r}. Convert them to one array library first."
            )
    return found or "numpy"


def ops_for(*arrays):
    """Returns the backend module shared by `arrays`."""
    return get_ops(common_backend(arrays))


__all__ = ["BACKENDS", "backend_of", "common_backend", "get_ops", "ops_for", "unwrap"]
