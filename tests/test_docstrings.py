"""The runnable examples in public docstrings stay true."""

import doctest
import importlib

import pytest

MODULES = [
    "lossscale.variables",
    "lossscale.optimizers.base",
    "lossscale.optimizers.sgd",
    "lossscale.optimizers.adam",
    "lossscale.optimizers.loss_scale_optimizer",
    "lossscale.schedules.base",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
