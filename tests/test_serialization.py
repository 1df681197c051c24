"""serialize / deserialize / get, and the registry."""

import json

import pytest

import lossscale as ls
from lossscale import serialization


def test_round_trip_through_json():
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam(0.05, amsgrad=True), initial_scale=64.0)
    data = json.loads(json.dumps(ls.optimizers.serialize(opt)))
    assert data["class_name"] == "LossScaleOptimizer"
    clone = ls.optimizers.deserialize(data)
    assert clone.get_config() == opt.get_config()


def test_get_by_name_instance_and_config():
    assert isinstance(ls.optimizers.get("adam"), ls.optimizers.Adam)
    assert isinstance(ls.optimizers.get("SGD"), ls.optimizers.SGD)
    opt = ls.optimizers.SGD()
    assert ls.optimizers.get(opt) is opt
    assert isinstance(ls.optimizers.get(ls.optimizers.serialize(opt)), ls.optimizers.SGD)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"Unknown optimizer name. Known: \[.*'adam'.*'sgd'.*\]. Received: identifier='adamx2'",
    ):
        ls.optimizers.get("adamx2")
    with pytest.raises(ValueError, match="Could not interpret optimizer identifier"):
        ls.optimizers.get(3)
    with pytest.raises(ValueError, match=r"Unknown class_name 'Nope'. Known: \[.*'Adam'"):
        ls.optimizers.deserialize({"class_name": "Nope", "config": {}})
    with pytest.raises(ValueError, match="must be a dict with keys 'class_name' and 'config'"):
        ls.optimizers.deserialize({"config": {}})


def test_unknown_config_keys_rejected():
    config = ls.optimizers.serialize(ls.optimizers.SGD())
    config["config"]["bogus"] = 1
    with pytest.raises(ValueError, match=r"The config of SGD has unknown key\(s\) \['bogus'\]"):
        ls.optimizers.deserialize(config)
    config = ls.LossScaleOptimizer(ls.optimizers.SGD()).get_config()
    config["extra"] = 2
    with pytest.raises(ValueError, match=r"LossScaleOptimizer has unknown key\(s\) \['extra'\]"):
        ls.LossScaleOptimizer.from_config(config)


def test_schedule_serialized_inside_optimizer():
    @serialization.register_serializable
    class Constant(ls.schedules.LearningRateSchedule):
        def __init__(self, value):
            self.value = value

        def __call__(self, step):
            return self.value

        def get_config(self):
            return {"value": self.value}

    config = ls.optimizers.SGD(learning_rate=Constant(0.3)).get_config()
    assert config["learning_rate"]["class_name"] == "Constant"
    clone = ls.optimizers.SGD.from_config(config)
    assert isinstance(clone._learning_rate, Constant) and clone._learning_rate.value == 0.3


def test_custom_objects_and_registered_name():
    class Mine(ls.optimizers.SGD):
        pass

    data = ls.optimizers.serialize(Mine(0.1))
    assert isinstance(ls.optimizers.deserialize(data, custom_objects={"Mine": Mine}), Mine)
    serialization.register_serializable(name="MyOwnSGD")(Mine)
    assert serialization.lookup("MyOwnSGD") is Mine
    assert "Adam" in serialization.registered_names()


def test_serialize_rejects_plain_objects():
    with pytest.raises(ValueError, match="must be an optimizer or learning-rate schedule"):
        serialization.serialize(object())


# Every registered class: a config from a file may lack a key or carry one
# too many; both are a ValueError naming the key, never a KeyError or a
# TypeError from deep inside a constructor.
REQUIRED = {
    "LossScaleOptimizer": ["inner_optimizer"],
    "ExponentialDecay": ["decay_rate", "decay_steps", "initial_learning_rate"],
    "InverseTimeDecay": ["decay_rate", "decay_steps", "initial_learning_rate"],
    "PolynomialDecay": ["decay_steps", "initial_learning_rate"],
    "PiecewiseConstantDecay": ["boundaries", "values"],
    "CosineDecay": ["decay_steps", "initial_learning_rate"],
    "CosineDecayRestarts": ["first_decay_steps", "initial_learning_rate"],
}


# The abstract base schedule has no config to read.
CONCRETE = [n for n in serialization.registered_names() if n != "LearningRateSchedule"]


@pytest.mark.parametrize("name", CONCRETE)
def test_missing_and_unknown_config_keys_are_value_errors(name):
    cls = serialization.lookup(name)
    required = REQUIRED.get(name, [])
    if required:
        with pytest.raises(
            ValueError,
            match=rf"The config of {name} is missing the key\(s\) \[{', '.join(map(repr, sorted(required)))}\]\. "
            r"Received: config with keys \['name'\]",
        ):
            cls.from_config({"name": "x"})
    config = ls.optimizers.serialize(_example(name))["config"]
    with pytest.raises(
        ValueError, match=rf"The config of {name} has unknown key\(s\) \['bogus'\]\. Accepted: \["
    ):
        cls.from_config({**config, "bogus": 1})
    assert type(cls.from_config(config)) is cls


def _example(name):
    schedules = {
        "ExponentialDecay": lambda: ls.schedules.ExponentialDecay(0.1, 2, 0.5),
        "InverseTimeDecay": lambda: ls.schedules.InverseTimeDecay(0.1, 2, 0.5),
        "PolynomialDecay": lambda: ls.schedules.PolynomialDecay(0.1, 2),
        "PiecewiseConstantDecay": lambda: ls.schedules.PiecewiseConstantDecay([2], [0.1, 0.01]),
        "CosineDecay": lambda: ls.schedules.CosineDecay(0.1, 2),
        "CosineDecayRestarts": lambda: ls.schedules.CosineDecayRestarts(0.1, 2),
    }
    if name in schedules:
        return schedules[name]()
    if name == "LossScaleOptimizer":
        return ls.LossScaleOptimizer(ls.optimizers.SGD())
    return getattr(ls.optimizers, name)()


def test_a_nested_config_must_be_a_dict():
    with pytest.raises(
        ValueError,
        match=r"`config\['config'\]` must be a dict of constructor arguments\. "
        r"Received: config\['config'\]=\[1\]",
    ):
        ls.optimizers.deserialize({"class_name": "Adam", "config": [1]})
    with pytest.raises(ValueError, match=r"`config` must be a dict of Adam's arguments\. "):
        ls.optimizers.Adam.from_config([("learning_rate", 0.1)])
