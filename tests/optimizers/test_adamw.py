"""AdamW: Adam with decoupled weight decay, by hand; the shared scenarios are `test_rules.py`'s."""

import numpy as np

import lossscale as ls
from lossscale.optimizers import Adam, AdamW


def test_is_adam_with_weight_decay_as_second_argument():
    assert isinstance(AdamW(), Adam)
    assert AdamW(0.1, 0.2).weight_decay == 0.2


def test_first_step_decays_then_takes_lr_times_sign(backend):
    # Decay first: w * (1 - 0.5 * 0.1) = [0.95, -1.9]; then Adam's first
    # step, lr * sign(g) (epsilon negligible).
    v = ls.Variable(backend.array(np.array([1.0, -2.0])))
    AdamW(0.1, weight_decay=0.5, epsilon=1e-12).apply([backend.array(np.array([0.5, -3.0]))], [v])
    np.testing.assert_allclose(backend.numpy(v), [0.85, -1.8], rtol=1e-6)
