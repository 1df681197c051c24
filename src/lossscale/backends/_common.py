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
    saved = [v._storage for v in variables]
    try:
        for v, s in zip(variables, storages):
            v._storage = s
        yield
    finally:
        for v, s in zip(variables, saved):
            v._storage = s


@contextlib.contextmanager
def masked(variables, mask):
    """Temporarily sets each variable's write mask to `mask`, restoring it on exit.

    While it is set, every write to those variables takes effect only where
    the mask holds (each backend's `assign*` reads it).
    """
    saved = [v._write_mask for v in variables]
    try:
        for v in variables:
            v._write_mask = mask
        yield
    finally:
        for v, previous in zip(variables, saved):
            v._write_mask = previous
