"""The private parts of torch that `lossscale.torch.GradScaler` relies on, checked at import.

`GradScaler` overrides private methods of `torch.amp.GradScaler` and reads
its `OptState` stages; on a torch whose internals differ `lossscale.torch`
refuses to load, naming the difference, rather than misbehave mid-training.
"""

import inspect

import torch

# The range of torch releases lossscale declares and tests (pyproject.toml).
SUPPORTED = "torch >= 2.13 (tested with 2.13)"

# Method name -> the parameters (after `self`) lossscale's overrides take.
METHODS = {
    "_lazy_init_scale_growth_tracker": ("dev",),
    "_check_scale_growth_tracker": ("funcname",),
    "_maybe_opt_step": ("optimizer", "optimizer_state", "args", "kwargs"),
    "_unscale_grads_": ("optimizer", "inv_scale", "found_inf", "allow_fp16"),
    "_check_inf_per_device": ("optimizer",),
}
OPT_STATES = ("READY", "UNSCALED", "STEPPED")


def problems():
    """What differs from the torch internals lossscale expects: a list of strings (empty: none)."""
    import torch.amp.grad_scaler as module

    found = []
    for name, expected in METHODS.items():
        method = getattr(module.GradScaler, name, None)
        if not callable(method):
            found.append(f"`GradScaler.{name}` is missing")
            continue
        try:
            params = tuple(inspect.signature(method).parameters)[1:]
        except (TypeError, ValueError):
            found.append(f"`GradScaler.{name}` has no readable signature")
            continue
        if params != expected:
            found.append(f"`GradScaler.{name}` takes {params}, where lossscale expects {expected}")
    stages = getattr(module, "OptState", None)
    members = tuple(getattr(stages, "__members__", ()))
    if stages is None:
        found.append("`torch.amp.grad_scaler.OptState` is missing")
    elif not set(OPT_STATES) <= set(members):
        found.append(f"`OptState` has the stages {members}, where lossscale expects {OPT_STATES}")
    return found


def check():
    """Raises `ImportError` if torch's internals are not those lossscale expects."""
    found = problems()
    if found:
        raise ImportError(
            f"lossscale.torch cannot run on torch {torch.__version__}: "
            + "; ".join(found)
            + f". lossscale.torch.GradScaler overrides these private parts of "
            f"torch.amp.GradScaler; lossscale supports {SUPPORTED}. Install a supported "
            "torch release, or a lossscale release made for this one."
        )
