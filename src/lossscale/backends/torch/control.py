"""Branches on device values, with no host read.

On a tensor predicate `cond` runs both branches, each followed by
`where(keep, written, before)` over the variables, so the branch not taken
leaves every tensor as it was. That costs a copy per variable per branch:
the hot path passes `keep` to the kernels instead.
"""

import torch


def cond(pred, true_fn, false_fn, variables):
    """Runs `true_fn` where `pred` holds and `false_fn` (or nothing) where it does not."""
    if not isinstance(pred, torch.Tensor):
        branch = true_fn if bool(pred) else false_fn
        if branch is not None:
            branch()
        return
    variables = list(variables)
    keep = pred if pred.dtype == torch.bool else pred.to(torch.bool)
    _where(keep, true_fn, variables)
    if false_fn is not None:
        _where(~keep, false_fn, variables)


def cond_values(pred, true_fn, false_fn):
    """`true_fn()` where `pred` holds, else `false_fn()`, with no host read of a tensor."""
    if not isinstance(pred, torch.Tensor):
        return true_fn() if bool(pred) else false_fn()
    keep = pred if pred.dtype == torch.bool else pred.to(torch.bool)
    return tuple(torch.where(keep, a, b) for a, b in zip(true_fn(), false_fn()))


def _where(keep, fn, variables):
    """Runs `fn`, then keeps its writes to `variables` only where `keep` holds."""
    with torch.no_grad():
        saved = [v.storage.clone() for v in variables]
    fn()
    with torch.no_grad():
        on = {}
        for v, old in zip(variables, saved):
            storage = v.storage
            device = storage.device
            flag = on.get(device)
            if flag is None:
                flag = on[device] = keep if keep.device == device else keep.to(device)
            torch.where(flag, storage, old, out=storage)
