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


def _fusable(params, slots):
    """Whether every variable (and its slots) is a `tf.Variable` of a fused dtype."""
    targets = list(params) + list(slots.get("momentums", ()))
    return all(ops.is_variable(v.storage) and v.storage.dtype in _FUSED_DTYPES for v in targets)


def sgd(update_step, params, slots, hyper, grads, learning_rate):
    """`SGD.update_step` for every variable, one fused kernel each."""
    if not _fusable(params, slots):
        for grad, variable in zip(grads, params):
            update_step(grad, variable, learning_rate)
        return
    nesterov = bool(hyper.nesterov)
    for i, (grad, variable) in enumerate(zip(grads, params)):
        storage = variable.storage
        lr = ops.cast(learning_rate, storage.dtype)
        grad = ops.cast(grad, storage.dtype)
        if hyper.momentum == 0:
            tf.raw_ops.ResourceApplyGradientDescent(var=storage.handle, alpha=lr, delta=grad)
            continue
        m = slots["momentums"][i].storage
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=storage.handle,
            accum=m.handle,
            lr=lr,
            grad=grad,
            momentum=ops.cast(hyper.momentum, storage.dtype),
            use_nesterov=nesterov,
        )
