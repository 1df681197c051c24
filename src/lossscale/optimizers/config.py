"""An optimizer's config, read off the `__init__` signatures of its class hierarchy."""

from __future__ import annotations

import inspect
from typing import Any

from lossscale.typing import Config
from lossscale.variables import Variable


def config_keys(cls: type) -> list[str]:
    """Every named constructor argument along the class hierarchy of `cls`."""
    keys = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.name != "self" and p.kind is not p.VAR_KEYWORD and p.name not in keys:
                keys.append(p.name)
    return keys


def config_of(optimizer: Any, learning_rate: Any) -> Config:
    """Every constructor argument of `optimizer`; `learning_rate` read from a `Variable`."""
    from lossscale import serialization

    config = {
        key: getattr(optimizer, key)
        for key in config_keys(type(optimizer))
        if key != "learning_rate"
    }
    config["learning_rate"] = (
        float(learning_rate.numpy())
        if isinstance(learning_rate, Variable)
        else serialization.serialize(learning_rate)
    )
    return config


def from_config(cls: type, config: Config, custom_objects: dict[str, Any] | None = None) -> Any:
    """An instance of `cls` made from `config` (the reverse of `config_of`)."""
    from lossscale import serialization, validation

    # "decay": a Keras 2 argument, accepted and ignored like Keras 3.
    validation.check_config(cls, config, accepted=[*config_keys(cls), "decay"])
    config = dict(config)
    if isinstance(config.get("learning_rate"), dict):
        config["learning_rate"] = serialization.deserialize(
            config["learning_rate"], custom_objects=custom_objects
        )
    return cls(**config)
