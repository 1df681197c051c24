"""Helpers shared by the built-in schedules (not part of the public API)."""

from __future__ import annotations

import inspect

from lossscale import validation
from lossscale.backends import ops_for
from lossscale.typing import Config

# Keras computes schedules in the dtype of `initial_learning_rate`, float32
# for a Python float; so do we, on the backend (and device) of the step.
DTYPE = "float32"


def float_step(step):
    """`(ops, step)`: the step's backend module and the step (any backend's) as float32."""
    ops = ops_for(step)
    return ops, ops.cast(step, DTYPE)


def signature_config(schedule) -> Config:
    """Every `__init__` argument of `schedule`, read from the attribute of that name."""
    parameters = inspect.signature(type(schedule).__init__).parameters
    return {name: getattr(schedule, name) for name in parameters if name != "self"}


def check_name(name):
    """Checks a schedule's `name` argument."""
    if not isinstance(name, str):
        raise ValueError(f"`name` must be a string. Received: name={name!r}")
    return name


def check_decay_steps(name, value):
    """Checks a decay horizon (`decay_steps`, `first_decay_steps`): a number > 0."""
    return validation.check_number(name, value, low=0, low_open=True)
