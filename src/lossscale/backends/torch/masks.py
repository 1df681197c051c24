"""Masked execution: branches on a device value, with no host read.

`cond(pred, true_fn, false_fn, variables)` on a tensor predicate runs both
branches, each with a `WriteMask` set on every variable it may write
(`variable._write_mask`; nested branches combine theirs), and every write
of a marked variable selects between the new and the old value on the
device (`select_into`). Nothing reads the predicate on the host, so a step
never waits for the device, and a value computed in the branch not taken (a
NaN from an overflowing gradient, say) is never stored. `gated(pred, fn,
variables)` is the true branch alone.

The mask travels with the variables, not through a context variable or a
thread-local: `torch.compile` traces attribute writes on Python objects,
and two threads stepping two optimizers never see each other's masks. It is
stored once per branch, in the cell the optimizer's variables share
(`_common.MaskCell`), not on each variable: a compiled step would guard on
and replay every one of those stores.
"""

import torch

from lossscale.backends._common import masked


class WriteMask:
    """Where the writes of a masked branch take effect.

    Attributes:
        keep: Boolean 0-d tensor: True where the branch's writes are kept.
    """

    __slots__ = ("keep", "_skip", "_on")

    def __init__(self, keep, skip=None):
        self.keep = keep
        self._skip = skip
        self._on = {}

    def on(self, device):
        """`keep` on `device` (moved once per device)."""
        if self.keep.device == device:
            return self.keep
        moved = self._on.get(device)
        if moved is None:
            moved = self._on[device] = self.keep.to(device)
        return moved

    def skip(self, device):
        """Float32 0-d tensor on `device`: 1.0 where writes are dropped, else 0.0.

        What torch's fused optimizer kernels take as `found_inf` (they skip
        the update where it is exactly 1.0) and `_amp_update_scale_` reads.
        """
        if self._skip is None:
            self._skip = (~self.keep).to(torch.float32)
        skip = self._skip
        return skip if skip.device == device else skip.to(device)


def mask_of(variables):
    """The `WriteMask` the variables carry (all alike inside a branch), or None."""
    return variables[0]._write_mask if variables else None


def select_into(storage, mask, new):
    """`storage[...] = where(mask.keep, new, storage)`, in place."""
    keep = mask.on(storage.device)
    if isinstance(new, torch.Tensor) and new.dtype == storage.dtype and new.shape == storage.shape:
        torch.where(keep, new, storage, out=storage)
    else:
        storage.copy_(torch.where(keep, new, storage))


def _combined(variables, keep):
    outer = mask_of(variables)
    if outer is None:
        return keep
    return outer.keep & keep.to(outer.keep.device)


def gated(pred, fn, variables, skip=None, cell=None):
    """Runs `fn` so that its writes to `variables` take effect only where `pred` holds.

    Args:
        pred: Boolean 0-d tensor (a Python or NumPy bool takes a plain `if`).
        fn: The branch, a function of no arguments.
        variables: Every `Variable` `fn` may write.
        skip: Optional float32 tensor, 1.0 where `pred` is False: the same
            flag in torch's AMP form, when the caller has it already.
        cell: Optional `MaskCell` every one of `variables` was pointed at
            (`masked` trusts it while it is intact).
    """
    if not isinstance(pred, torch.Tensor):
        if bool(pred):
            fn()
        return
    variables = list(variables)
    keep = pred if pred.dtype == torch.bool else pred.to(torch.bool)
    outer = mask_of(variables)
    mask = WriteMask(_combined(variables, keep), skip if outer is None else None)
    with masked(variables, mask, cell):
        fn()


def cond(pred, true_fn, false_fn, variables):
    """Runs `true_fn` where `pred` holds and `false_fn` where it does not.

    A Python (or NumPy) boolean takes a plain `if`. A tensor is never read on
    the host: both branches run, each under its mask, and the masked writes
    keep what the branch not taken would have stored out of every variable
    in `variables` (every variable either branch may write). `false_fn` may
    be None: nothing to do there.
    """
    if not isinstance(pred, torch.Tensor):
        branch = true_fn if bool(pred) else false_fn
        if branch is not None:
            branch()
        return
    variables = list(variables)
    keep = pred if pred.dtype == torch.bool else pred.to(torch.bool)
    with masked(variables, WriteMask(_combined(variables, keep))):
        true_fn()
    if false_fn is not None:
        with masked(variables, WriteMask(_combined(variables, ~keep))):
            false_fn()
