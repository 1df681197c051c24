"""Lion: the edges of its arguments' ranges; the shared scenarios are `test_rules.py`'s."""

from lossscale.optimizers import Lion


def test_beta_1_of_one_is_accepted():
    assert Lion(beta_1=1.0).beta_1 == 1.0  # as in Keras: the range is (0, 1]
