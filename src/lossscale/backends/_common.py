"""Helpers shared by the backend modules (no backend imports here)."""

import contextlib


def unwrap(x):
    """Returns the native array behind a `lossscale.Variable`, else `x`."""
    return x.value if getattr(x, "_is_lossscale_variable", False) else x


@contextlib.contextmanager
def bound(variables, storages):
    """Temporarily rebinds each variable's storage, restoring it on exit.

    Used by stateless application and by JAX's `lax.cond`, which both run
    the ordinary stateful code against values that are not the variables'
    own.
    """
    saved = [v.storage for v in variables]
    try:
        for v, s in zip(variables, storages):
            v.rebind(s)
        yield
    finally:
        for v, s in zip(variables, saved):
            v.rebind(s)


def unscale_then_check(unscale, finite_flags, grads, scale, in_place=False):
    """`(unscaled, finite, skip)`: `unscale`, then `finite_flags` of its result.

    A backend's `unscale_checked` where no kernel does both in one pass.
    """
    unscaled = unscale(grads, scale, in_place)
    return (unscaled, *finite_flags(unscaled))
