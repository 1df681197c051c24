"""`DemoConfig`: defaults and every rejected value."""

import doctest
import re

import pytest

from lossscale.demo import config as config_module
from lossscale.demo.config import DEFAULT_LOSS_WEIGHT, DEFAULT_STEPS, DemoConfig


def test_defaults():
    config = DemoConfig()
    assert (
        config.steps,
        config.seed,
        config.out,
        config.initial_scale,
        config.growth_steps,
        config.diagnostics_every,
        config.backend,
        config.loss_weight,
        config.batch_size,
    ) == (DEFAULT_STEPS, 0, "lossscale-demo", 2.0**15, 50, 50, "torch", 2.0**-16, 128)
    assert DEFAULT_LOSS_WEIGHT == 2.0**-16


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("steps", 0, "an integer >= 1"),
        ("steps", 1.5, "an integer >= 1"),
        ("seed", -1, "an integer >= 0"),
        ("initial_scale", 0.0, "a finite number > 0"),
        ("initial_scale", float("inf"), "a finite number > 0"),
        ("growth_steps", 0, "an integer >= 1"),
        ("diagnostics_every", 0, "an integer >= 1"),
        ("diagnostics_every", 2.5, "an integer >= 1"),
        ("backend", "mxnet", "one of ('torch', 'numpy', 'jax', 'tensorflow')"),
        ("loss_weight", -1.0, "a finite number > 0"),
        ("batch_size", 1438, "an integer >= 1 and <= 1437"),
        ("learning_rate", 0, "a finite number > 0"),
        ("hidden_units", 0, "an integer >= 1"),
        ("progress", 1, "a boolean"),
    ],
)
def test_rejects(name, value, accepted):
    message = f"`{name}` must be {accepted}. Received: {name}={value!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        DemoConfig(**{name: value})


@pytest.mark.parametrize("out", ["", None])
def test_rejects_an_empty_out(out):
    with pytest.raises(
        ValueError, match=re.escape(f"`out` must be a non-empty path string. Received: out={out!r}")
    ):
        DemoConfig(out=out)


def test_docstring_example():
    result = doctest.testmod(config_module)
    assert result.attempted > 0 and result.failed == 0
