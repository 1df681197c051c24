"""`GradScaler`'s arguments as torch accepts them: `enabled=1`, `init_scale=torch.tensor(8.0)`."""

import numbers

import numpy as np
import torch


def as_enabled(enabled):
    """`enabled` as torch takes it: a bool, or an integer used as one (`enabled=1`)."""
    if isinstance(enabled, (bool, np.bool_)) or (
        isinstance(enabled, numbers.Integral) and enabled in (0, 1)
    ):
        return bool(enabled)
    raise ValueError(f"`enabled` must be a boolean (or 0 or 1). Received: enabled={enabled!r}")


def as_number(name, value):
    """A one-element real tensor (`init_scale=torch.tensor(8.0)`, as torch accepts) as a float."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(
                f"`{name}` must be a positive number or a one-element real tensor. "
                f"Received: {name}=tensor of shape {tuple(value.shape)}, dtype {value.dtype}"
            )
        return float(value.detach().reshape(()).to(torch.float64))
    return value


def is_real(x):
    """Whether `x` is a real number (not a bool)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
