"""Learning-rate schedules."""

from lossscale import serialization
from lossscale.schedules.base import LearningRateSchedule

__all__ = ["LearningRateSchedule"]

for _name in __all__:
    serialization.register_serializable(globals()[_name])
