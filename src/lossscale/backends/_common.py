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


def unscale_then_check(unscale, finite_flags, grads, scale, in_place=False):
    """`(unscaled, finite, skip)`: `unscale`, then `finite_flags` of its result.

    A backend's `unscale_checked` where no kernel does both in one pass.
    """
    unscaled = unscale(grads, scale, in_place)
    return (unscaled, *finite_flags(unscaled))


class MaskCell:
    """The write mask shared by a group of variables (`variable._mask_cell`).

    A variable's `_write_mask` is its cell's `mask`. An optimizer points
    every variable it creates or is built with at one cell of its own, so
    that masking a whole step is one store into that cell, not one per
    variable: under `torch.compile` each store on a variable is a guard and
    a side effect replayed after every call.

    Attributes:
        mask: None, or the backend's mask (torch: `masks.WriteMask`; JAX and
            TensorFlow: a boolean scalar).
        intact: True while no variable ever pointed at this cell has been
            pointed at another since: every such variable still shares it.
            An optimizer's masked step then trusts the cell without reading
            each variable's (under `torch.compile` every read is a guard).
    """

    __slots__ = ("mask", "intact")

    def __init__(self, mask=None):
        self.mask = mask
        self.intact = True


def share_mask_cell(variables, cell):
    """Points each of `variables` at `cell` (outside any masked branch)."""
    for v in variables:
        _point(v, cell)


def _point(variable, cell):
    old = variable._mask_cell
    if old is not None and old is not cell:
        old.intact = False
    variable._mask_cell = cell


@contextlib.contextmanager
def masked(variables, mask, cell=None):
    """Temporarily sets the write mask of `variables` to `mask`, restoring it on exit.

    While it is set, every write to those variables takes effect only where
    the mask holds (each backend's `assign*` reads it).

    When the variables all share one cell (one optimizer's), the mask is set
    on that cell: its other variables are masked too while the branch runs,
    which changes nothing, as a branch writes only the variables it names.
    Otherwise they move to a new cell of their own; on exit, a variable
    whose old cell is still masked (an enclosing branch's) moves back, and
    the others stay, so the next branch over the same variables finds them
    sharing one cell.

    Args:
        variables: The variables the branch may write.
        mask: The mask to set, or None (writes unmasked).
        cell: Optional: the cell every one of `variables` was pointed at
            (`share_mask_cell`), as an optimizer's own variables were. While
            it is `intact` it is used without reading any variable's.
    """
    if cell is None or not cell.intact:
        variables = list(variables)
        cell = _shared_cell(variables)
    moved = ()
    if cell is None:
        cell = MaskCell()
        moved = [(v, v._mask_cell) for v in variables]
        share_mask_cell(variables, cell)
    previous, cell.mask = cell.mask, mask
    try:
        yield
    finally:
        cell.mask = previous
        for v, old in moved:
            if old is not None and old.mask is not None:
                _point(v, old)


def _shared_cell(variables):
    """The cell every one of `variables` points at, or None."""
    cell = variables[0]._mask_cell if variables else None
    if cell is None or any(v._mask_cell is not cell for v in variables):
        return None
    return cell
