"""SGD on TensorFlow's own fused training kernels.

`ResourceApplyGradientDescent` and `ResourceApplyKerasMomentum` equal
`SGD.update_step` bit for bit in float32 and float64. They write through a
`tf.Variable`'s handle, so tensors (`stateless_apply`) and other dtypes take
`update_step`. No Adam: `ResourceApplyAdam` computes `1 - beta` in float32,
where Keras rounds it once from float64.
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
