"""One place for argument checks, with Keras-style messages.

Every message names the argument, says what is accepted and shows what was
received: "`dynamic_growth_steps` must be an integer >= 1. Received:
dynamic_growth_steps=0".
"""

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
    """Checks a real (or integer) number against optional bounds.

    Args:
        name: Argument name used in the message.
        value: The received value.
        low, high: Optional bounds.
        low_open, high_open: Whether the bound itself is excluded.
        allow_none: Whether `None` is accepted.
        integer: Whether only integers are accepted.

    Returns:
        `value` (unchanged) when it is accepted.
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
