"""The TensorFlow backend's kernel registry: update rules by name.

An optimizer class names the kernel that reproduces its `update_step`
(`Optimizer.update_kernel`). Here SGD runs on TensorFlow's fused training
kernels (`fused.sgd`) and every other rule is the optimizer's own
`update_step`, variable by variable; either way an eager step traces the
rule once and replays it (`compiled.run`), and inside a `tf.function` the
rule joins the caller's graph. Each entry has a test proving it equals
`update_step` bit for bit (tests/test_tensorflow_kernels.py). Nothing here
knows an optimizer class: the names are the whole contract.
"""

import tensorflow as tf

from lossscale.backends.tensorflow import compiled, fused, ops


def _per_variable(optimizer, variables, grads, learning_rate):
    for grad, variable in zip(grads, variables):
        optimizer.update_step(grad, variable, learning_rate)


def _sgd(optimizer, variables, grads, learning_rate):
    fused.sgd(optimizer, grads, variables, learning_rate)


def _decay(optimizer, variables, learning_rate, weight_decay):
    # `weight_decay.apply_weight_decay`'s loop, exactly.
    for variable in variables:
        lr = ops.cast(learning_rate, variable.dtype)
        variable.assign_sub(variable.value * weight_decay * lr)


def _as_tensor(learning_rate):
    # A Python number becomes a float64 tensor: cast to a variable's dtype
    # it rounds once, as the number itself would.
    learning_rate = ops._tensor(learning_rate)
    if isinstance(learning_rate, tf.Tensor):
        return learning_rate
    return tf.constant(learning_rate, tf.float64)


def _traced(rule):
    def kernel(optimizer, grads, variables, learning_rate):
        compiled.run(optimizer, rule, variables, (list(grads), _as_tensor(learning_rate)))

    return kernel


_UPDATE = _traced(_per_variable)

KERNELS = {
    "sgd": _traced(_sgd),
    **{
        name: _UPDATE
        for name in (
            "adam",
            "rmsprop",
            "adagrad",
            "adadelta",
            "adamax",
            "nadam",
            "lion",
            "ftrl",
            "lamb",
        )
    },
}


def fused_update(name):
    """The kernel `(optimizer, grads, variables, learning_rate)` named `name`, or None."""
    return KERNELS.get(name)


def weight_decay(optimizer, variables, weight_decay, learning_rate):
    """Decoupled weight decay of `variables`, traced once when eager (see `compiled`)."""
    compiled.run(
        optimizer, _decay, variables, (_as_tensor(learning_rate), weight_decay), (weight_decay,)
    )


def fused_weight_decay():
    """Decoupled weight decay of many variables at once (see `weight_decay`)."""
    return weight_decay


def fused_scale_update():
    """None: the generic selects of `next_loss_scale` are this backend's path."""
    return None
