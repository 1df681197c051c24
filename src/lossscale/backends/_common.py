"""Helpers shared by the backend modules (no backend imports here)."""

import contextlib


def unwrap(x):
    """Returns the native array behind a `lossscale.Variable`, else `x`."""
    return x.value if getattr(x, "_is_lossscale_variable", False) else x


def unary(fn):
    """`fn` taking a `Variable` too."""
    return lambda x: fn(unwrap(x))


def binary(fn):
    """`fn` of two arguments, each may be a `Variable`."""
    return lambda x, y: fn(unwrap(x), unwrap(y))


@contextlib.contextmanager
def bound(variables, storages):
    """Temporarily rebinds each variable's storage (stateless application, `lax.cond`)."""
    saved = [v.storage for v in variables]
    try:
        for v, s in zip(variables, storages):
            v.rebind(s)
        yield
    finally:
        for v, s in zip(variables, saved):
            v.rebind(s)


def unscale_then_check(unscale, finite_flags, grads, scale, in_place=False):
    """`(unscaled, finite, skip)`: `unscale`, then `finite_flags` of its result."""
    unscaled = unscale(grads, scale, in_place)
    return (unscaled, *finite_flags(unscaled))
