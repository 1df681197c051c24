"""`tf.train.Checkpoint` of a model plus a lossscale optimizer's variables."""

import doctest

import numpy as np
import pytest
import tensorflow as tf

import lossscale as ls
import lossscale.tensorflow
from lossscale.tensorflow import checkpoint as checkpoint_module

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


class Model(tf.Module):
    def __init__(self, seed):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.kernel = tf.Variable(rng.normal(size=(4, 3)).astype(np.float32), name="kernel")
        self.bias = tf.Variable(np.zeros(3, np.float32), name="bias")

    @property
    def weights(self):
        return [self.kernel, self.bias]


def _optimizer(model):
    opt = ls.LossScaleOptimizer(
        ls.optimizers.AdamW(0.01, weight_decay=0.1), initial_scale=64.0, dynamic_growth_steps=2
    )
    opt.build(model.weights)
    return opt


def _steps(model, opt, seed, count):
    rng = np.random.default_rng(seed)
    step = tf.function(lambda grads: opt.apply(grads, model.weights))
    for t in range(count):
        grads = [rng.normal(size=w.shape).astype(np.float32) * 64.0 for w in model.weights]
        if t == 1:
            grads[0][0, 0] = np.inf
        step([tf.constant(g) for g in grads])


def test_a_checkpoint_restores_the_model_and_the_optimizer_and_training_resumes(tmp_path):
    model = Model(0)
    opt = _optimizer(model)
    _steps(model, opt, seed=1, count=5)
    saved = tf.train.Checkpoint(model=model, optimizer=ls.tensorflow.trackable(opt))
    path = saved.save(str(tmp_path / "ckpt"))
    _steps(model, opt, seed=2, count=3)

    twin = Model(99)  # other weights, a fresh optimizer
    twin_opt = _optimizer(twin)
    status = tf.train.Checkpoint(model=twin, optimizer=ls.tensorflow.trackable(twin_opt)).restore(
        path
    )
    status.assert_consumed()
    # 64 -> f -> inf (32) -> f -> f (grown: 64) -> f: four applied steps.
    assert int(twin_opt.iterations) == 4 and float(twin_opt.dynamic_scale) == 64.0
    assert int(twin_opt.step_counter) == 1
    _steps(twin, twin_opt, seed=2, count=3)
    for a, b in zip(
        model.weights + [v.storage for v in opt.variables],
        twin.weights + [v.storage for v in twin_opt.variables],
    ):
        np.testing.assert_array_equal(b.numpy(), a.numpy())


def test_the_optimizer_must_be_built_on_tensorflow():
    with pytest.raises(ValueError, match=r"`optimizer` must be built, so that all of its"):
        ls.tensorflow.trackable(ls.optimizers.Adam())
    opt = ls.optimizers.Adam()
    opt.build([np.ones(2, np.float32)])
    with pytest.raises(ValueError, match=r"Received: an optimizer on 'numpy'"):
        ls.tensorflow.trackable(opt)
    with pytest.raises(ValueError, match=r"must be a lossscale.optimizers.Optimizer"):
        ls.tensorflow.trackable(object())


def test_docstring_example():
    result = doctest.testmod(checkpoint_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
