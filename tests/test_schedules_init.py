"""`lossscale.schedules`: every schedule exported and registered for deserialization."""

import json

import pytest

import lossscale as ls
from lossscale import serialization

BUILT_IN = {
    "CosineDecay": {"initial_learning_rate": 0.1, "decay_steps": 10},
    "CosineDecayRestarts": {"initial_learning_rate": 0.1, "first_decay_steps": 10},
    "ExponentialDecay": {"initial_learning_rate": 0.1, "decay_steps": 10, "decay_rate": 0.5},
    "InverseTimeDecay": {"initial_learning_rate": 0.1, "decay_steps": 10, "decay_rate": 0.5},
    "PiecewiseConstantDecay": {"boundaries": [10], "values": [0.1, 0.01]},
    "PolynomialDecay": {"initial_learning_rate": 0.1, "decay_steps": 10},
}


def test_exports():
    assert sorted(ls.schedules.__all__) == sorted([*BUILT_IN, "LearningRateSchedule"])


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_each_schedule_is_a_registered_learning_rate_schedule(name):
    cls = getattr(ls.schedules, name)
    assert issubclass(cls, ls.schedules.LearningRateSchedule)
    assert serialization.lookup(name) is cls
    schedule = cls(**BUILT_IN[name])
    payload = json.loads(json.dumps(serialization.serialize(schedule)))
    assert payload == {
        "module": cls.__module__,
        "class_name": name,
        "config": schedule.get_config(),
    }
    assert serialization.deserialize(payload).get_config() == schedule.get_config()


def test_user_schedule_round_trips_through_an_optimizer_with_custom_objects():
    class Halving(ls.schedules.LearningRateSchedule):
        def __init__(self, initial):
            self.initial = initial

        def __call__(self, step):
            return self.initial * 0.5 ** (step // 10)

        def get_config(self):
            return {"initial": self.initial}

    optimizer = ls.optimizers.Lion(learning_rate=Halving(0.3))
    config = json.loads(json.dumps(optimizer.get_config()))
    rebuilt = ls.optimizers.Lion.from_config(config, custom_objects={"Halving": Halving})
    assert isinstance(rebuilt._learning_rate, Halving)
    assert rebuilt._learning_rate.initial == 0.3
