"""SGD on TensorFlow's own fused training kernels.

`ResourceApplyGradientDescent` (`var -= lr * grad`) and
`ResourceApplyKerasMomentum` (`accum = accum * momentum - grad * lr`, then
`var += accum`, or with Nesterov `var += accum * momentum - grad * lr`) are
Keras's SGD rule in one kernel per variable instead of three to six ops,
and equal `SGD.update_step` bit for bit in float32 and float64 (the tests
check it). They write through a `tf.Variable`'s handle, so variables bound
to plain tensors (`stateless_apply`) and other dtypes take `update_step`.

There is no Adam here: `ResourceApplyAdam` computes `1 - beta_1` and
`1 - beta_2` in float32, where Keras (and `Adam.update_step`) computes them
in Python's float64 and rounds once; `1 - float32(0.999)` is 1.3e-5 larger
than `float32(1 - 0.999)`, a bias in every second-moment update that grows
over a run. Adam takes `update_step`, traced once (`compiled`).
"""

import tensorflow as tf

from lossscale.backends.tensorflow import ops

_FUSED_DTYPES = (tf.float32, tf.float64)


def _fusable(optimizer, variables):
    """Whether every variable (and its slots) is an unmasked `tf.Variable` of a fused dtype.

    A masked write (an eager branch, see `control`) needs a select the
    kernels do not make; `compiled` runs them under `tf.cond` instead.
    """
    targets = list(variables) + [m for m in optimizer.momentums if m is not None]
    return all(
        v._write_mask is None and ops.is_variable(v._storage) and v._storage.dtype in _FUSED_DTYPES
        for v in targets
    )


def sgd(optimizer, grads, variables, learning_rate):
    """`SGD.update_step` for every variable, one fused kernel each."""
    if not _fusable(optimizer, variables):
        for grad, variable in zip(grads, variables):
            optimizer.update_step(grad, variable, learning_rate)
        return
    nesterov = bool(optimizer.nesterov)
    for grad, variable in zip(grads, variables):
        storage = variable._storage
        lr = ops.cast(learning_rate, storage.dtype)
        grad = ops.cast(grad, storage.dtype)
        if optimizer.momentum == 0:
            tf.raw_ops.ResourceApplyGradientDescent(var=storage.handle, alpha=lr, delta=grad)
            continue
        m = optimizer.momentums[optimizer._get_variable_index(variable)]._storage
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=storage.handle,
            accum=m.handle,
            lr=lr,
            grad=grad,
            momentum=ops.cast(optimizer.momentum, storage.dtype),
            use_nesterov=nesterov,
        )
