"""optimizers/loss_scale_delegation.py: what `LossScaleOptimizer` hands to its inner optimizer."""

import numpy as np
import pytest

from lossscale.optimizers import SGD
from tests.optimizers.test_loss_scale_optimizer import SHAPES, scalar, setup
from tests.reference import ReferenceOptimizer, adam_rule

# These hand pre-scaled gradients to `apply` without `scale_loss`.
pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


def test_ema_and_finalize_delegate(backend, rng):
    init, variables, opt = setup(
        backend, rng, inner=SGD(0.1, use_ema=True, ema_momentum=0.5), initial_scale=4.0
    )
    ref = ReferenceOptimizer(adam_rule(), init)  # only its EMA bookkeeping is used
    ref.use_ema, ref.ema_momentum = True, 0.5
    for kind in ["f", "nan", "f"]:
        grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
        if kind == "nan":
            grads[0][0, 0] = np.nan
        scale = np.float32(scalar(backend, opt.dynamic_scale))
        opt.apply([backend.array(g * scale) for g in grads], variables)
        if kind == "f":
            ref.w = [w - 0.1 * g for w, g in zip(ref.w, grads)]
            m = 0.0 if ref.raw_iterations == 0 else 0.5
            ref.avg = [m * a + (1 - m) * w for a, w in zip(ref.avg, ref.w)]
            ref.raw_iterations += 1
    opt.finalize_variable_values(variables)
    for v, a in zip(variables, ref.avg):
        np.testing.assert_allclose(backend.numpy(v), a, rtol=1e-5, atol=1e-6)


def test_properties_read_and_write_through(backend, rng):
    _, variables, opt = setup(backend, rng, inner=SGD(0.1))
    opt.learning_rate = 0.25
    assert float(backend.numpy(opt.inner_optimizer.learning_rate)) == 0.25
    opt.apply([backend.array(np.ones(s, np.float32)) for s in SHAPES], variables)
    assert opt.iterations is opt.inner_optimizer.iterations
    opt.iterations = 7
    assert scalar(backend, opt.inner_optimizer.iterations) == 7
    names = [v.name for v in opt.variables]
    assert names[:2] == ["step_counter", "dynamic_scale"]
    assert names[2:] == [v.name for v in opt.inner_optimizer.variables]
    assert opt.dynamic_scale.dtype == "float32"
    assert opt.step_counter.dtype.startswith("int")


def test_exclude_from_weight_decay_reaches_the_inner_optimizer(backend, rng):
    init, variables, opt = setup(backend, rng, inner=SGD(0.1, weight_decay=0.5), initial_scale=2.0)
    opt.exclude_from_weight_decay(var_names=["v1"])
    opt.scale_loss(1.0)
    opt.apply([backend.array(np.zeros(s, np.float32)) for s in SHAPES], variables)
    np.testing.assert_allclose(backend.numpy(variables[0]), init[0] * (1 - 0.05), rtol=1e-6)
    np.testing.assert_array_equal(backend.numpy(variables[1]), init[1])
