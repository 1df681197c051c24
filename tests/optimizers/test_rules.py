"""Every optimizer of the table (`tests/optimizer_table.py`) through every shared scenario.

The float64 reference over a grid of options, weight decay and clipping;
inside `LossScaleOptimizer`; `stateless_apply` and its `jax.jit`; the config
round trip; resuming from config and saved variables; Keras's defaults; the
bad arguments and their messages; the docstring example. What is specific
to one optimizer stays in `test_<name>.py`.
"""

import functools
import re

import pytest

from tests import optimizer_cases as cases
from tests.optimizer_table import ROWS


def _grid():
    return [
        pytest.param(row, options, weight_decay, clip, id=f"{row.name}-{variant}-{case}")
        for row in ROWS
        for variant, options in row.variants.items()
        for case, (weight_decay, clip) in row.cases.items()
    ]


def _rows():
    return [pytest.param(row, id=row.name) for row in ROWS]


def _bad():
    return [
        pytest.param(row, kwargs, message, id=f"{row.name}-{i}-{next(iter(kwargs))}")
        for row in ROWS
        for i, (kwargs, message) in enumerate(row.bad)
    ]


@pytest.mark.parametrize("row, options, weight_decay, clip", _grid())
def test_matches_float64_reference(backend, row, options, weight_decay, clip):
    cases.check_reference(
        backend,
        functools.partial(row.cls, **options),
        row.rule(**options),
        row.learning_rate,
        weight_decay,
        **clip,
    )


@pytest.mark.parametrize("row", _rows())
def test_inside_loss_scale_optimizer(backend, row):
    cases.check_loss_scale(backend, row.cls, **row.loss_scale)


@pytest.mark.parametrize("row", _rows())
def test_stateless_apply_matches_apply(backend, row):
    cases.check_stateless(backend, row.cls, **row.stateless)


@pytest.mark.parametrize("row", _rows())
def test_jit_stateless_apply_matches_eager(row):
    cases.check_jit(row.cls, **row.jit)


@pytest.mark.parametrize("row", _rows())
def test_config_round_trip(row):
    cases.check_config_round_trip(row.cls, **row.config)


@pytest.mark.parametrize("row", _rows())
def test_resumes_from_config_and_saved_variables(backend, row):
    cases.check_resume(backend, row.cls, **row.resume)


@pytest.mark.parametrize("row", _rows())
def test_defaults_follow_keras(row):
    optimizer = row.cls()
    defaults = dict(row.defaults)
    assert float(optimizer.learning_rate) == pytest.approx(defaults.pop("learning_rate"))
    assert {key: getattr(optimizer, key) for key in defaults} == defaults


@pytest.mark.parametrize("row, kwargs, message", _bad())
def test_bad_arguments_raise(row, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        row.cls(**kwargs)


@pytest.mark.parametrize("row", _rows())
def test_docstring_example(row):
    cases.check_doctest(row.module)
