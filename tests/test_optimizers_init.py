"""`lossscale.optimizers`: every optimizer exported, registered and reachable by name."""

import ast
import json
import re

import pytest

import lossscale as ls
from lossscale import serialization

FAMILY = [
    "Adadelta",
    "Adagrad",
    "Adam",
    "Adamax",
    "AdamW",
    "Ftrl",
    "Lamb",
    "Lion",
    "Nadam",
    "RMSprop",
    "SGD",
]
SCHEDULES = [
    "CosineDecay",
    "CosineDecayRestarts",
    "ExponentialDecay",
    "InverseTimeDecay",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
]


def test_every_optimizer_is_exported_and_listed():
    for name in FAMILY + ["LossScaleOptimizer", "Optimizer"]:
        assert name in ls.optimizers.__all__
        assert getattr(ls.optimizers, name).__name__ == name
    assert set(ls.optimizers.ALL_OPTIMIZERS) == {
        getattr(ls.optimizers, name) for name in FAMILY + ["LossScaleOptimizer"]
    }


@pytest.mark.parametrize("name", FAMILY)
def test_get_by_name_any_case(name):
    for identifier in (name, name.lower(), name.upper()):
        optimizer = ls.optimizers.get(identifier)
        assert type(optimizer) is getattr(ls.optimizers, name)


@pytest.mark.parametrize("name", FAMILY)
def test_serialize_deserialize_round_trip(name):
    optimizer = getattr(ls.optimizers, name)(learning_rate=0.5, clipnorm=1.0)
    payload = json.loads(json.dumps(ls.optimizers.serialize(optimizer)))
    assert payload["class_name"] == name
    assert payload["module"] == type(optimizer).__module__
    for rebuilt in (ls.optimizers.deserialize(payload), ls.optimizers.get(payload)):
        assert type(rebuilt) is type(optimizer)
        assert rebuilt.get_config() == optimizer.get_config()


def test_unknown_name_lists_every_known_name():
    with pytest.raises(ValueError) as info:
        ls.optimizers.get("adamwx")
    message = str(info.value)
    assert message.endswith("Received: identifier='adamwx'")
    listed = re.search(r"Known: (\[.*\])", message).group(1)
    assert sorted(ast.literal_eval(listed)) == sorted(name.lower() for name in FAMILY)


@pytest.mark.parametrize("name", FAMILY + SCHEDULES + ["LossScaleOptimizer"])
def test_deserialize_knows_every_class(name):
    assert name in serialization.registered_names()
    assert serialization.lookup(name).__name__ == name


def test_wrapped_family_member_round_trips():
    wrapped = ls.LossScaleOptimizer(
        ls.optimizers.Nadam(
            learning_rate=ls.schedules.CosineDecay(0.1, 100, warmup_target=0.2, warmup_steps=10)
        ),
        initial_scale=256.0,
    )
    payload = json.loads(json.dumps(ls.optimizers.serialize(wrapped)))
    rebuilt = ls.optimizers.deserialize(payload)
    assert type(rebuilt.inner_optimizer) is ls.optimizers.Nadam
    assert type(rebuilt.inner_optimizer._learning_rate) is ls.schedules.CosineDecay
    assert rebuilt.get_config() == wrapped.get_config()
