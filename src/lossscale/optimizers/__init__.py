"""Optimizers: the base class, the loss-scale wrapper and the update rules."""

from __future__ import annotations

from typing import Any

from lossscale import serialization
from lossscale.optimizers.adadelta import Adadelta
from lossscale.optimizers.adagrad import Adagrad
from lossscale.optimizers.adam import Adam
from lossscale.optimizers.adamax import Adamax
from lossscale.optimizers.adamw import AdamW
from lossscale.optimizers.base import Optimizer
from lossscale.optimizers.ftrl import Ftrl
from lossscale.optimizers.lamb import Lamb
from lossscale.optimizers.lion import Lion
from lossscale.optimizers.loss_scale_optimizer import LossScaleOptimizer
from lossscale.optimizers.nadam import Nadam
from lossscale.optimizers.native import wrap_native
from lossscale.optimizers.rmsprop import RMSprop
from lossscale.optimizers.sgd import SGD
from lossscale.typing import Config

ALL_OPTIMIZERS = (
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    Ftrl,
    Lamb,
    Lion,
    LossScaleOptimizer,
    Nadam,
    RMSprop,
    SGD,
)
for _cls in ALL_OPTIMIZERS:
    serialization.register_serializable(_cls)

# Lower-case aliases accepted by `get`.
_ALIASES = {cls.__name__.lower(): cls for cls in ALL_OPTIMIZERS if cls is not LossScaleOptimizer}


def serialize(optimizer: Optimizer) -> Config:
    """Returns `{"module", "class_name", "config"}` for an optimizer."""
    return serialization.serialize(optimizer)


def deserialize(config: Config, custom_objects: dict[str, Any] | None = None) -> Optimizer:
    """Rebuilds an optimizer from `serialize`'s output."""
    return serialization.deserialize(config, custom_objects=custom_objects)


def get(identifier: Optimizer | str | Config) -> Optimizer:
    """Returns an optimizer from an instance, a name (`"adam"`) or a config dict.

    Raises:
        ValueError: For an unknown name or an uninterpretable identifier.
    """
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, dict):
        return deserialize(identifier)
    if isinstance(identifier, str):
        cls = _ALIASES.get(identifier.lower())
        if cls is None:
            raise ValueError(
                f"Unknown optimizer name. Known: {sorted(_ALIASES)}. "
                f"Received: identifier={identifier!r}"
            )
        return cls()
    raise ValueError(
        "Could not interpret optimizer identifier: expected an Optimizer, a name or a config "
        f"dict. Received: identifier={identifier!r}"
    )


__all__ = [
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Ftrl",
    "Lamb",
    "Lion",
    "LossScaleOptimizer",
    "Nadam",
    "Optimizer",
    "RMSprop",
    "SGD",
    "deserialize",
    "get",
    "serialize",
    "wrap_native",
]
