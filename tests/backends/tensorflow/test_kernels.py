"""Every TensorFlow kernel equals its optimizer's `update_step`, bit for bit.

For each name in the registry, the class that declares it steps the same
scenario twice, eagerly: with the kernels (traced once, `compiled`) and
with the registry emptied (the per-variable `update_step`, op by op). Inside
`LossScaleOptimizer` an overflowing step among them must write nothing.
"""

import numpy as np
import pytest
import tensorflow as tf

import lossscale as ls
from lossscale.backends.tensorflow import kernels

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")

# The class declaring each kernel name, with settings that reach its branches.
DECLARING = {
    "sgd": lambda: ls.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: ls.optimizers.Adam(0.02, amsgrad=True),
    "rmsprop": lambda: ls.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: ls.optimizers.Adagrad(0.1),
    "adadelta": lambda: ls.optimizers.Adadelta(1.0, epsilon=1e-3),
    "adamax": lambda: ls.optimizers.Adamax(0.02),
    "nadam": lambda: ls.optimizers.Nadam(0.02),
    "lion": lambda: ls.optimizers.Lion(0.01),
    "ftrl": lambda: ls.optimizers.Ftrl(0.1, l1_regularization_strength=0.01, beta=0.5),
    "lamb": lambda: ls.optimizers.Lamb(0.02),
}


def test_every_rule_is_traced_without_a_name_list():
    # SGD has TensorFlow's fused training kernels; any other name, or none
    # (a user's rule), traces the optimizer's own `update_step`.
    assert sorted(kernels.KERNELS) == ["sgd"]
    traced = kernels.fused_update(None)
    assert traced is not None and traced.folds_keep
    for name, make in DECLARING.items():
        assert type(make()).update_kernel == name
        assert kernels.fused_update(name) is (kernels.KERNELS["sgd"] if name == "sgd" else traced)


def _trajectory(make, wrap, seed=4):
    rng = np.random.default_rng(seed)
    variables = [tf.Variable(rng.normal(size=s).astype(np.float32)) for s in [(5, 3), (3,)]]
    opt = make()
    if wrap:
        opt = ls.LossScaleOptimizer(opt, initial_scale=4.0, dynamic_growth_steps=2)
    history = []
    for t in range(5):
        grads = [rng.normal(size=v.shape).astype(np.float32) * 4.0 for v in variables]
        if wrap and t == 2:
            grads[1][0] = np.inf
        opt.apply([tf.constant(g) for g in grads], variables)
        history.append([v.numpy() for v in variables] + [v.numpy() for v in opt.variables])
    return history


@pytest.mark.parametrize("wrap", [False, True], ids=["bare", "loss_scaled"])
@pytest.mark.parametrize("name", sorted(DECLARING))
def test_kernel_equals_update_step(name, wrap, monkeypatch):
    with_kernels = _trajectory(DECLARING[name], wrap)
    monkeypatch.setattr(ls.backends.get_ops("tensorflow"), "fused_update", lambda name: None)
    reference = _trajectory(DECLARING[name], wrap)
    for t, (got, want) in enumerate(zip(with_kernels, reference)):
        for i, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g, w, err_msg=f"{name} step {t} value {i}")


def test_weight_decay_kernel_equals_the_loop(monkeypatch):
    make = lambda: ls.optimizers.Lion(0.01, weight_decay=0.3)  # noqa: E731
    with_kernel = _trajectory(make, True)
    monkeypatch.setattr(kernels, "fused_weight_decay", lambda: None)
    monkeypatch.setattr(ls.backends.get_ops("tensorflow"), "fused_weight_decay", lambda: None)
    reference = _trajectory(make, True)
    for got, want in zip(with_kernel, reference):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
