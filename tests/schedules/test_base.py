"""`LearningRateSchedule`: what a subclass must override, and `from_config` checked against `__init__`."""

import doctest

import numpy as np
import pytest

import lossscale as ls
from lossscale.backends import ops_for
from lossscale.schedules import base


class Halving(ls.schedules.LearningRateSchedule):
    def __init__(self, initial, every=10):
        self.initial, self.every = initial, every

    def __call__(self, step):
        ops = ops_for(step)
        return self.initial * 0.5 ** ops.cast(step // self.every, "float32")

    def get_config(self):
        return {"initial": self.initial, "every": self.every}


def test_a_subclass_runs_on_every_backend(backend):
    for step, expected in [(0, 0.3), (9, 0.3), (10, 0.15), (35, 0.0375)]:
        got = backend.numpy(Halving(0.3)(backend.array(np.int32(step))))
        np.testing.assert_allclose(got, np.float32(0.3 * 0.5 ** (step // 10)), rtol=1e-7)
        assert got.dtype == np.float32
        assert abs(float(got) - expected) <= 1e-7


def test_what_is_not_overridden_raises_naming_the_class():
    class Bare(ls.schedules.LearningRateSchedule):
        pass

    with pytest.raises(
        NotImplementedError,
        match=r"^Learning rate schedule 'Bare' must override `__call__\(self, step\)`.$",
    ):
        Bare()(np.int32(0))
    with pytest.raises(
        NotImplementedError,
        match=r"^Learning rate schedule 'Bare' must override `get_config\(\)` in order to be "
        r"serializable.$",
    ):
        Bare().get_config()


def test_from_config_returns_the_class_it_is_called_on():
    schedule = Halving.from_config(Halving(0.5, every=4).get_config())
    assert type(schedule) is Halving
    assert (schedule.initial, schedule.every) == (0.5, 4)
    assert Halving.from_config({"initial": 2.0}).every == 10  # defaults fill the rest


def test_from_config_is_checked_against_init():
    with pytest.raises(
        ValueError,
        match=r"^The config of Halving is missing the key\(s\) \['initial'\]. "
        r"Received: config with keys \['every'\]$",
    ):
        Halving.from_config({"every": 3})
    with pytest.raises(
        ValueError,
        match=r"^The config of Halving has unknown key\(s\) \['rate'\]. Accepted: "
        r"\['every', 'initial'\]. Received: config with keys \['initial', 'rate'\]$",
    ):
        Halving.from_config({"initial": 1.0, "rate": 3})
    with pytest.raises(ValueError, match=r"Received: config=\[1.0\]"):
        Halving.from_config([1.0])


def test_docstring_example():
    result = doctest.testmod(base, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
