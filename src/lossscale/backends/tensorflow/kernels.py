"""The TensorFlow backend's kernel registry: update rules by name.

An optimizer class names the kernel that reproduces its `update_step`
(`Optimizer.update_kernel`). Here SGD runs on TensorFlow's fused training
kernels (`fused.sgd`) and every other rule, whatever its name (a user's
subclass too), is the optimizer's own `update_step`, variable by variable;
either way an eager step traces the rule once and replays it
(`compiled.run`), and inside a `tf.function` the rule joins the caller's
graph. Each entry has a test proving it equals
`update_step` bit for bit (tests/backends/tensorflow/test_kernels.py). Nothing here
knows an optimizer class: a kernel gets its state as arguments
(`lossscale.backends.kernel`).
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
    # A Python number becomes a float64 tensor: cast to a variable's dtype
    # it rounds once, as the number itself would.
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
            # `update_step` reads a step count derived from a variable bound
            # to a tensor (gradient accumulation under `stateless_apply`):
            # no trace could take it as an input, so the rule runs op by op.
            if keep is None:
                rule(*static, *inputs)
            else:
                control.cond(keep, lambda: rule(*static, *inputs), None, targets)
            return
        compiled.run(rule, static, targets, inputs, cache, tuple(hyper), keep)

    return kernel


# Any rule is the optimizer's own `update_step`, traced once under `tf.cond`
# on the step's `keep` flag; SGD has TensorFlow's fused training kernels.
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
