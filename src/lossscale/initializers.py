"""Initializers for `Variable`s created from a shape and dtype.

Values are made in NumPy and then placed on the target backend, so every
backend starts from identical numbers.
"""

import numpy as np

_BUILTIN = {
    "zeros": lambda shape, dtype: np.zeros(shape, dtype=dtype),
    "ones": lambda shape, dtype: np.ones(shape, dtype=dtype),
    "random_normal": lambda shape, dtype: (
        np.random.default_rng().normal(0.0, 0.05, size=shape).astype(dtype)
    ),
    "random_uniform": lambda shape, dtype: (
        np.random.default_rng().uniform(-0.05, 0.05, size=shape).astype(dtype)
    ),
}


def get(initializer):
    """Returns a callable `(shape, dtype) -> np.ndarray` for `initializer`.

    Args:
        initializer: One of `"zeros"`, `"ones"`, `"random_normal"`,
            `"random_uniform"`, a Python number (constant fill) or a callable
            taking `(shape, dtype)`.

    Returns:
        A callable `(shape, dtype)` returning an array.
    """
    if isinstance(initializer, str) and initializer in _BUILTIN:
        return _BUILTIN[initializer]
    if isinstance(initializer, (int, float, np.number)) and not isinstance(initializer, bool):
        return lambda shape, dtype: np.full(shape, initializer, dtype=dtype)
    if callable(initializer):
        return initializer
    raise ValueError(
        f"`initializer` must be one of {tuple(_BUILTIN)}, a number or a callable. "
        f"Received: initializer={initializer!r}"
    )
