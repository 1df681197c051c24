"""The private parts of torch that `lossscale.torch.GradScaler` relies on, checked at import.

`GradScaler` subclasses `torch.amp.GradScaler` and overrides five of its
private methods (torch's public methods call them), and reads torch's
private `OptState` stages. torch may change any of them in a release
without notice, so `lossscale.torch` checks them when it is imported, and
refuses to load on a torch whose internals differ, naming the difference,
the torch release and the range lossscale supports, rather than failing (or
silently misbehaving) in the middle of a training step.
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


def problems(scaler_class=None, grad_scaler_module=None):
    """What differs from the torch internals lossscale expects: a list of strings (empty: none).

    Args:
        scaler_class: The class to check; defaults to `torch.amp.GradScaler`.
        grad_scaler_module: The module holding `OptState`; defaults to
            `torch.amp.grad_scaler`.
    """
    if scaler_class is None or grad_scaler_module is None:
        import torch.amp.grad_scaler as module

        scaler_class = scaler_class or module.GradScaler
        grad_scaler_module = grad_scaler_module or module
    found = []
    for name, expected in METHODS.items():
        method = getattr(scaler_class, name, None)
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
    stages = getattr(grad_scaler_module, "OptState", None)
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
