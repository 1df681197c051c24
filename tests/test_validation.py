"""The shared argument checks and their messages."""

import pytest

from lossscale import validation


def test_check_number_accepts_and_returns():
    assert validation.check_number("x", 0.5, low=0, high=1) == 0.5
    assert validation.check_number("x", None, allow_none=True) is None
    assert validation.check_number("n", 3, low=1, integer=True) == 3


@pytest.mark.parametrize(
    "value, kwargs, message",
    [
        (0, {"low": 0, "low_open": True}, "`x` must be a finite number > 0. Received: x=0"),
        (
            1.0,
            {"low": 0, "high": 1, "high_open": True},
            "`x` must be a finite number >= 0 and < 1. Received: x=1.0",
        ),
        (float("nan"), {}, "`x` must be a finite number. Received: x=nan"),
        (True, {}, "`x` must be a finite number. Received: x=True"),
        ("1", {"allow_none": True}, "`x` must be a finite number or None. Received: x='1'"),
        (1.5, {"integer": True, "low": 1}, "`x` must be an integer >= 1. Received: x=1.5"),
    ],
)
def test_check_number_messages(value, kwargs, message):
    with pytest.raises(ValueError) as info:
        validation.check_number("x", value, **kwargs)
    assert str(info.value) == message


def test_check_bool_and_choice():
    assert validation.check_bool("flag", False) is False
    with pytest.raises(ValueError, match="`flag` must be a boolean. Received: flag=0"):
        validation.check_bool("flag", 0)
    assert validation.check_choice("mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"`mode` must be one of \('a', 'b'\). Received: mode='c'"):
        validation.check_choice("mode", "c", ("a", "b"))
