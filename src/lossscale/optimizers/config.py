"""An optimizer's config (`ConfigMixin`), derived from its constructor.

Hyperparameters are `__init__` arguments stored under the same attribute
names, so the config is read off the signatures of the class hierarchy and
never written by hand.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

from lossscale.typing import Config
from lossscale.variables import Variable

# `from_config` returns an instance of the class it is called on.
_ConfigT = TypeVar("_ConfigT", bound="ConfigMixin")


class ConfigMixin:
    """`get_config` / `from_config` for `Optimizer`."""

    @classmethod
    def _config_keys(cls):
        """Every named constructor argument along the class hierarchy."""
        keys = []
        for klass in cls.__mro__:
            if "__init__" not in vars(klass) or klass is object:
                continue
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.name != "self" and p.kind is not p.VAR_KEYWORD and p.name not in keys:
                    keys.append(p.name)
        return keys

    def get_config(self) -> Config:
        """Returns the optimizer's config: every constructor argument, by name."""
        from lossscale import serialization

        config = {key: getattr(self, key) for key in self._config_keys() if key != "learning_rate"}
        lr = self._learning_rate
        config["learning_rate"] = (
            float(lr.numpy()) if isinstance(lr, Variable) else (serialization.serialize(lr))
        )
        return config

    @classmethod
    def from_config(
        cls: type[_ConfigT], config: Config, custom_objects: dict[str, Any] | None = None
    ) -> _ConfigT:
        """Creates an optimizer from its config (the reverse of `get_config`).

        Args:
            config: A Python dictionary, typically the output of `get_config`.
            custom_objects: A dictionary mapping names to user-defined
                classes or functions needed to recreate this optimizer.

        Returns:
            An optimizer instance.
        """
        from lossscale import serialization, validation

        # "decay": a Keras 2 argument, accepted and ignored like Keras 3.
        validation.check_config(cls, config, accepted=[*cls._config_keys(), "decay"])
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = serialization.deserialize(
                config["learning_rate"], custom_objects=custom_objects
            )
        return cls(**config)
