"""The TensorFlow backend's kernel registry: update rules by name (see `backends.kernel`).

SGD runs on TensorFlow's fused training kernels (`fused.sgd`), any other
rule is the optimizer's own `update_step`; an eager step traces either once
(`compiled.run`).
"""

import tensorflow as tf

from lossscale.backends.kernel import Kernel
from lossscale.backends.tensorflow import compiled, control, float16_range, fused, ops


def _per_variable(update_step, params, slots, hyper, grads, learning_rate):
    del slots, hyper  # `update_step` reads the optimizer's own
    for grad, variable in zip(grads, params):
        update_step(grad, variable, learning_rate)


def _decay(params, weight_decay, learning_rate):
    # `weight_decay.apply_weight_decay`'s loop, exactly.
    for variable in params:
        lr = ops.cast(learning_rate, variable.dtype)
        variable.assign_sub(variable.value * weight_decay * lr)


def _as_tensor(learning_rate):
    # A Python number as float64: cast to a variable's dtype it rounds once.
    learning_rate = ops._tensor(learning_rate)
    if isinstance(learning_rate, tf.Tensor):
        return learning_rate
    return tf.constant(learning_rate, tf.float64)


def _targets(params, slots, iterations):
    """Every `Variable` a rule may read or write: parameters, slots, the step count."""
    targets, seen = [], set()
    for v in [*params, *(v for lst in slots.values() for v in lst), iterations]:
        if getattr(v, "_is_lossscale_variable", False) and id(v) not in seen:
            seen.add(id(v))
            targets.append(v)
    return targets


def _traced(rule):
    def kernel(params, grads, slots, hyper, *, iterations, lr, update_step, cache, keep=None):
        static = (update_step, params, slots, hyper)
        targets = _targets(params, slots, iterations)
        inputs = (list(grads), _as_tensor(lr))
        if not getattr(iterations, "_is_lossscale_variable", False) and not all(
            ops.is_variable(v.storage) for v in targets
        ):
            # A step count derived from a variable bound to a tensor (gradient
            # accumulation under `stateless_apply`): no trace takes it as input.
            if keep is None:
                rule(*static, *inputs)
            else:
                control.cond(keep, lambda: rule(*static, *inputs), None, targets)
            return
        compiled.run(rule, static, targets, inputs, cache, tuple(hyper), keep)

    return kernel


_UPDATE = Kernel(_traced(_per_variable), folds_keep=True)
KERNELS = {"sgd": Kernel(_traced(fused.sgd), folds_keep=True)}


def fused_update(name):
    """The `Kernel` named `name`; any other name, or None, traces the rule's `update_step`."""
    return KERNELS.get(name, _UPDATE)


def weight_decay(params, weight_decay, lr, *, cache, keep=None):
    """Decoupled weight decay of `params`, traced once when eager (see `compiled`)."""
    inputs = (_as_tensor(lr),)
    compiled.run(_decay, (params, weight_decay), list(params), inputs, cache, (weight_decay,), keep)


def fused_weight_decay():
    """Decoupled weight decay of many variables at once (see `weight_decay`)."""
    return weight_decay


def fused_scale_update():
    """None: the generic selects of `next_loss_scale` are this backend's path."""
    return None


def fused_float16_range():
    """Many gradients' float16 range, a large one a chunk at a time (see `float16_range`)."""
    return float16_range.measure
