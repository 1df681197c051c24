"""What every demo model must do (not a test module): tests/demo/models/test_<backend>_mlp.py.

Each backend's model trains, keeps its float32 master weights as
`lossscale.Variable`s, hands back gradients of its variables' shapes in the
pass's precision, and runs single-threaded inside `single_threaded()`. The
gradients themselves are checked against a float64 autograd oracle, for
every backend at once, in tests/test_demo_models.py.
"""

import functools

import pytest
from threadpoolctl import threadpool_info

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.demo import data as digits
from lossscale.demo.models import make_model, single_threaded

HIDDEN = 16


@functools.cache
def batch(size=128):
    data = digits.load_digits(0)
    return data.x_train[:size], data.y_train[:size]


def model(backend):
    return make_model(backend, digits.initial_weights(0, HIDDEN))


def native_shapes(backend):
    """The variables' shapes: torch's `nn.Linear` stores `(out, in)`, the others `(in, out)`."""
    shapes = [(64, HIDDEN), (HIDDEN,), (HIDDEN, 10), (10,)]
    return [s[::-1] for s in shapes] if backend == "torch" else shapes


def check_gradients_have_the_variables_shapes_and_the_pass_dtype(backend, precision):
    ops = get_ops(backend)
    net = model(backend)
    x, y = batch()
    loss, grads = net.gradients(x, y, precision, 1.0, lambda loss: loss * 8.0)
    assert ops.dtype_name(loss) == "float32" and tuple(ops.shape(loss)) == ()
    assert [tuple(ops.shape(g)) for g in grads] == native_shapes(backend)
    assert [ops.dtype_name(g) for g in grads] == [precision] * 4
    assert [tuple(v.shape) for v in net.variables] == native_shapes(backend)
    loss_value, accuracy = net.evaluate(*batch())
    assert type(loss_value) is float and type(accuracy) is float
    assert loss_value == pytest.approx(float(loss), rel=1e-6 if precision == "float32" else 5e-3)
    assert accuracy in {k / 128 for k in range(129)}


def check_training_lowers_the_loss(backend, precision, steps=15):
    """`steps` Adam steps on one batch (float16: under `LossScaleOptimizer`) train the model."""
    net = model(backend)
    x, y = batch()
    adam = ls.optimizers.Adam(learning_rate=2e-2)
    opt = ls.LossScaleOptimizer(adam, initial_scale=2.0**8) if precision == "float16" else adam
    scale_loss = opt.scale_loss if precision == "float16" else (lambda loss: loss)
    loss_before, accuracy_before = net.evaluate(x, y)
    losses = []
    for _ in range(steps):
        loss, grads = net.gradients(x, y, precision, 1.0, scale_loss)
        opt.apply(grads, net.variables)
        losses.append(float(loss))
    loss_after, accuracy_after = net.evaluate(x, y)
    assert int(opt.iterations) == steps  # no step skipped
    assert losses[0] == pytest.approx(loss_before, rel=1e-6 if precision == "float32" else 5e-3)
    assert loss_after < 0.6 * loss_before, (loss_before, losses, loss_after)
    assert accuracy_after > accuracy_before + 0.2
    for v in net.variables:
        assert v.dtype == "float32"  # the master weights stay float32


def blas_threads():
    return {pool["user_api"]: pool["num_threads"] for pool in threadpool_info()}


def check_single_threaded_limits_the_pools_and_restores_them(backend):
    before = blas_threads()
    with single_threaded(backend):
        inside = blas_threads()
        model(backend).gradients(*batch(), "float32", 1.0, lambda loss: loss)
    assert inside and set(inside.values()) == {1}
    assert blas_threads() == before
