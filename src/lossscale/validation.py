"""Argument checks with Keras-style messages: "`x` must be an integer >= 1. Received: x=0"."""

import inspect
import math
import numbers


def _fail(name, accepted, value, error=ValueError):
    raise error(f"`{name}` must be {accepted}. Received: {name}={value!r}")


def check_number(
    name,
    value,
    *,
    low=None,
    high=None,
    low_open=False,
    high_open=False,
    allow_none=False,
    integer=False,
):
    """Returns `value`, a real (or integer) number within the optional bounds, or raises.

    `low_open`, `high_open`: whether the bound itself is excluded.
    """
    if value is None and allow_none:
        return value
    kind = "an integer" if integer else "a finite number"
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high}")
    accepted = kind + (" " + " and ".join(parts) if parts else "")
    if allow_none:
        accepted += " or None"
    ok_type = isinstance(value, numbers.Integral) if integer else isinstance(value, numbers.Real)
    if isinstance(value, bool) or not ok_type:
        _fail(name, accepted, value)
    if not integer and not math.isfinite(value):
        _fail(name, accepted, value)
    if low is not None and (value <= low if low_open else value < low):
        _fail(name, accepted, value)
    if high is not None and (value >= high if high_open else value > high):
        _fail(name, accepted, value)
    return value


def check_bool(name, value):
    """Checks that `value` is a Python bool."""
    if not isinstance(value, bool):
        _fail(name, "a boolean", value)
    return value


def check_choice(name, value, choices):
    """Checks that `value` is one of `choices`."""
    if value not in choices:
        _fail(name, f"one of {tuple(choices)}", value)
    return value


def dtype_kind(dtype):
    """`"float"`, `"int"`, `"bool"` or `"complex"` for a dtype or dtype name."""
    name = str(dtype).removeprefix("torch.")
    for kind in ("bool", "int", "float", "complex"):
        if kind in name:
            return kind
    return name


def check_config(cls, config, accepted=None):
    """Returns `config` if it holds every required argument of `cls.__init__` and only `accepted`.

    `accepted` defaults to the named arguments of `cls.__init__`.
    """
    if not isinstance(config, dict):
        _fail("config", f"a dict of {cls.__name__}'s arguments", config)
    parameters = [
        p
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    required = sorted(p.name for p in parameters if p.default is p.empty and p.name not in config)
    if required:
        raise ValueError(
            f"The config of {cls.__name__} is missing the key(s) {required}. "
            f"Received: config with keys {sorted(config)}"
        )
    accepted = [p.name for p in parameters] if accepted is None else list(accepted)
    unknown = sorted(set(config) - set(accepted))
    if unknown:
        raise ValueError(
            f"The config of {cls.__name__} has unknown key(s) {unknown}. Accepted: "
            f"{sorted(accepted)}. Received: config with keys {sorted(config)}"
        )
    return config


def check_axis_name(axis_name, process_group):
    """Checks a loss scaler's `axis_name` (JAX's mapped axes) against its `process_group`."""
    if axis_name is None:
        return
    if not (
        (isinstance(axis_name, str) and axis_name)
        or (
            isinstance(axis_name, tuple)
            and axis_name
            and all(isinstance(a, str) and a for a in axis_name)
        )
    ):
        raise ValueError(
            "`axis_name` must be a mapped axis name (a non-empty string) or a non-empty tuple "
            f"of them, or None. Received: axis_name={axis_name!r}"
        )
    if process_group is not None:
        raise ValueError(
            "Pass `process_group` (torch.distributed) or `axis_name` (JAX `shard_map` / "
            f"`pmap`), not both. Received: process_group={process_group!r}, "
            f"axis_name={axis_name!r}"
        )
