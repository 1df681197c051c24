"""`ConfigMixin`: an optimizer's config read off its constructors' signatures, and back."""

import json

import numpy as np
import pytest

import lossscale as ls
from lossscale.optimizers import SGD, Optimizer

BASE = [
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
]


class Scaled(SGD):
    """A user's subclass with an argument of its own (stored under its name)."""

    def __init__(self, factor=2.0, momentum=0.5, **kwargs):
        super().__init__(momentum=momentum, **kwargs)
        self.factor = factor


def test_keys_follow_the_class_hierarchy_most_derived_first():
    assert SGD._config_keys() == ["learning_rate", "momentum", "nesterov", "name", *BASE]
    # A subclass's own arguments first; one named again (momentum) keeps its first place.
    assert Scaled._config_keys() == [
        "factor",
        "momentum",
        "learning_rate",
        "nesterov",
        "name",
        *BASE,
    ]
    assert "kwargs" not in Optimizer._config_keys()


def test_get_config_reads_every_argument_and_the_rate_as_a_float32():
    config = SGD(0.1, momentum=0.9, nesterov=True, clipnorm=1.5, name="opt").get_config()
    assert list(config) == [k for k in SGD._config_keys() if k != "learning_rate"] + [
        "learning_rate"
    ]
    assert config["learning_rate"] == float(np.float32(0.1)) == 0.10000000149011612
    assert config["momentum"] == 0.9 and config["nesterov"] is True
    assert config["clipnorm"] == 1.5 and config["name"] == "opt"
    assert config["weight_decay"] is None and config["use_ema"] is False
    assert json.loads(json.dumps(config)) == config


def test_a_schedule_is_serialized_inside_the_config():
    schedule = ls.schedules.ExponentialDecay(0.5, decay_steps=10, decay_rate=0.9)
    config = SGD(schedule).get_config()
    assert config["learning_rate"] == ls.serialization.serialize(schedule)
    rebuilt = SGD.from_config(json.loads(json.dumps(config)))
    assert isinstance(rebuilt._learning_rate, ls.schedules.ExponentialDecay)
    assert rebuilt._learning_rate.get_config() == schedule.get_config()


def test_from_config_round_trips_a_subclass():
    original = Scaled(3.0, learning_rate=0.25, weight_decay=0.01)
    rebuilt = Scaled.from_config(original.get_config())
    assert type(rebuilt) is Scaled and rebuilt.factor == 3.0 and rebuilt.momentum == 0.5
    assert rebuilt.get_config() == original.get_config()


def test_from_config_accepts_keras_2s_decay_and_refuses_unknown_keys():
    config = {**SGD(0.1).get_config(), "decay": 0.0}
    assert SGD.from_config(config).get_config() == SGD(0.1).get_config()
    with pytest.raises(
        ValueError,
        match=r"^The config of SGD has unknown key\(s\) \['bogus'\]. Accepted: \['clipnorm', "
        r"'clipvalue', 'decay', ",
    ):
        SGD.from_config({"learning_rate": 0.1, "bogus": 1})
    with pytest.raises(ValueError, match=r"a dict of SGD's arguments. Received: config=None"):
        SGD.from_config(None)


def test_from_config_leaves_the_given_dict_alone():
    schedule = ls.schedules.ExponentialDecay(0.5, decay_steps=10, decay_rate=0.9)
    config = SGD(schedule).get_config()
    before = json.dumps(config, sort_keys=True)
    SGD.from_config(config)
    assert json.dumps(config, sort_keys=True) == before
