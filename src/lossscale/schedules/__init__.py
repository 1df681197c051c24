"""Learning-rate schedules: the base class users subclass and Keras 3's decays."""

from lossscale import serialization
from lossscale.schedules.base import LearningRateSchedule
from lossscale.schedules.cosine_decay import CosineDecay, CosineDecayRestarts
from lossscale.schedules.exponential_decay import ExponentialDecay
from lossscale.schedules.inverse_time_decay import InverseTimeDecay
from lossscale.schedules.piecewise_constant_decay import PiecewiseConstantDecay
from lossscale.schedules.polynomial_decay import PolynomialDecay

__all__ = [
    "CosineDecay",
    "CosineDecayRestarts",
    "ExponentialDecay",
    "InverseTimeDecay",
    "LearningRateSchedule",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
]

for _name in __all__:
    serialization.register_serializable(globals()[_name])
