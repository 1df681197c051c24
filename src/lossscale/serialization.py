"""Registry of serializable classes and `serialize` / `deserialize`.

A serialized object is `{"module": ..., "class_name": ..., "config": ...}`,
the shape Keras uses, holding only plain Python values: it round-trips
through JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from lossscale.typing import Config

_T = TypeVar("_T", bound=type)

_REGISTRY: dict[str, type] = {}


def register_serializable(
    cls: _T | None = None, *, name: str | None = None
) -> _T | Callable[[_T], _T]:
    """Registers a class so `deserialize` finds it by `class_name`.

    Usable as `@register_serializable` or `@register_serializable(name=...)`.
    """

    def register(klass: _T) -> _T:
        _REGISTRY[name or klass.__name__] = klass
        return klass

    return register(cls) if cls is not None else register


def registered_names() -> list[str]:
    """The class names `deserialize` knows without `custom_objects`."""
    _load_builtins()
    return sorted(_REGISTRY)


def serialize(obj: Any) -> Config:
    """Returns the config dict of an optimizer or schedule."""
    if not hasattr(obj, "get_config"):
        raise ValueError(
            "`obj` must be an optimizer or learning-rate schedule with `get_config()`. "
            f"Received: obj={obj!r}"
        )
    return {
        "module": type(obj).__module__,
        "class_name": type(obj).__name__,
        "config": obj.get_config(),
    }


def deserialize(config: Config, custom_objects: dict[str, Any] | None = None) -> Any:
    """Rebuilds an object from `serialize`'s output.

    Args:
        config: A dict with `class_name` and `config`.
        custom_objects: Optional dict mapping class names to user classes.

    Returns:
        A new optimizer or schedule.
    """
    if not isinstance(config, dict) or "class_name" not in config or "config" not in config:
        raise ValueError(
            "`config` must be a dict with keys 'class_name' and 'config'. "
            f"Received: config={config!r}"
        )
    if not isinstance(config["config"], dict):
        raise ValueError(
            "`config['config']` must be a dict of constructor arguments. "
            f"Received: config['config']={config['config']!r}"
        )
    cls = lookup(config["class_name"], custom_objects)
    if hasattr(cls, "from_config"):
        try:
            return cls.from_config(dict(config["config"]), custom_objects=custom_objects)
        except TypeError as error:
            if "custom_objects" not in str(error):
                raise
            return cls.from_config(dict(config["config"]))
    return cls(**config["config"])


def lookup(name: str, custom_objects: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Finds a class by name in `custom_objects`, then in the registry."""
    if custom_objects and name in custom_objects:
        return custom_objects[name]
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    raise ValueError(
        f"Unknown class_name {name!r}. Known: {sorted(_REGISTRY)}; pass user classes in "
        f"`custom_objects`. Received: class_name={name!r}"
    )


def _load_builtins():
    # Importing the packages registers their classes.
    import lossscale.optimizers  # noqa: F401
    import lossscale.schedules  # noqa: F401,F811
