"""Checks and messages of the native-optimizer adapters (`TorchAdapter`)."""

import numbers

import numpy as np

from lossscale import validation


def check_value(where, value, variable):
    """Raises unless `value` (a tensor, NumPy array or number) fits `variable`."""
    import torch

    if not isinstance(value, (torch.Tensor, np.ndarray, np.generic, numbers.Number)) or (
        isinstance(value, bool)
    ):
        raise ValueError(
            f"`{where}` must be a tensor, a NumPy array or a number. Received: {value!r}"
        )
    shape = tuple(getattr(value, "shape", ()))
    if shape != variable.shape:
        raise ValueError(
            f"`{where}` must have the shape {variable.shape} of optimizer variable "
            f"{variable.path!r}. Received: shape {shape}"
        )
    expected = validation.dtype_kind(variable.dtype)
    if validation.dtype_kind(getattr(value, "dtype", np.asarray(value).dtype)) != expected:
        raise ValueError(
            f"`{where}` must hold {expected} values like optimizer variable "
            f"{variable.path!r} ({variable.dtype}). Received: {value!r}"
        )


STATELESS_MESSAGE = (
    "TorchAdapter does not support stateless application: the native torch optimizer "
    "keeps its state outside lossscale variables and updates the parameters themselves in "
    "place, so it cannot run on given values. Use `apply` (also through a "
    "LossScaleOptimizer), or a lossscale optimizer such as lossscale.optimizers.Adam."
)


def store_message(method, optimizer):
    return (
        f"TorchAdapter does not support `{method}`: the wrapped "
        f"{type(optimizer).__name__} keeps its state in `optimizer.state`, not in lossscale "
        "variables, so a variable store would hold the step counter only. Use `state_dict()` "
        "and `load_state_dict()` (with torch.save / torch.load) instead."
    )
