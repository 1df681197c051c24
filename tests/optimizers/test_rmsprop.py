"""RMSprop: the order of its slots; the shared scenarios are `test_rules.py`'s."""

from lossscale.optimizers import RMSprop
from tests import optimizer_cases as cases


def test_slots_follow_options():
    w = cases.weights()
    assert [v.name for v in _built(RMSprop(), w).variables] == [
        "iteration",
        "learning_rate",
        "param_0_velocity",
        "param_1_velocity",
    ]
    names = [v.name for v in _built(RMSprop(momentum=0.5, centered=True), w).variables]
    # Keras's order: all velocities, then all momentums, then all averages.
    assert names[2:] == [
        "param_0_velocity",
        "param_1_velocity",
        "param_0_momentum",
        "param_1_momentum",
        "param_0_average_gradient",
        "param_1_average_gradient",
    ]


def _built(optimizer, w):
    optimizer.build(w)
    return optimizer
