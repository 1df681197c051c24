"""Branches on device values, with no host read.

`cond(pred, true_fn, false_fn, variables)` on a tensor predicate runs both
branches. Each runs in place on the variables it may write, then every one
of them takes `where(keep, value written, value before)`, so the branch not
taken leaves every tensor bit for bit as it was, and a value computed there
(a NaN from an overflowing gradient, say) is never kept. Nothing reads the
predicate on the host, so a step never waits for the device.

That costs a copy of each variable per branch: the optimizer's hot path
does not take it. A skipped loss-scale step passes its flag to the kernels
instead (`keep`, see `lossscale.backends.kernel`), which fold it into
their own writes (`plans.Writer`) or arithmetic (`found_inf`).
"""

import torch


def cond(pred, true_fn, false_fn, variables):
    """Runs `true_fn` where `pred` holds and `false_fn` where it does not.

    A Python (or NumPy) boolean takes a plain `if`. A tensor is never read on
    the host: both branches run, and what the branch not taken stored is
    undone in every variable of `variables` (every variable either branch
    may write). `false_fn` may be None: nothing to do there.
    """
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
    """`true_fn()` where `pred` holds, else `false_fn()`, with no host read of a tensor.

    A tensor predicate runs both and selects each array (`torch.where`).
    """
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
