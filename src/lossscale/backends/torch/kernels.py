"""The torch backend's kernel registry: multi-tensor update rules by name.

An optimizer class names the kernel that reproduces its `update_step`
(`Optimizer.update_kernel`); `fused_update(name)` returns that kernel, or
None when there is none and the per-variable `update_step` runs. Adam,
AdamW and SGD run on torch's fused kernels (`fused`), the others on
`torch._foreach_*` rules (`foreach`). Each entry has a test proving it
equals `update_step` (tests/test_torch_fused.py, tests/test_torch_foreach.py).
Nothing here knows an optimizer class: the names are the whole contract.
"""

from lossscale.backends.torch import adamw, foreach, fused


def _slots(*attrs):
    return lambda optimizer: attrs


def _rmsprop_slots(optimizer):
    return (
        ("_velocities",)
        + (("_momentums",) if optimizer.momentum > 0 else ())
        + (("_average_gradients",) if optimizer.centered else ())
    )


KERNELS = {
    "adam": fused.adam,
    "sgd": fused.sgd,
    "rmsprop": foreach.make_kernel(foreach.rmsprop, _rmsprop_slots),
    "adagrad": foreach.make_kernel(foreach.adagrad, _slots("_accumulators")),
    "adadelta": foreach.make_kernel(
        foreach.adadelta, _slots("_accumulated_grads", "_accumulated_delta_vars")
    ),
    "adamax": foreach.make_kernel(foreach.adamax, _slots("_m", "_u")),
    "nadam": foreach.make_kernel(foreach.nadam, _slots("_momentums", "_velocities")),
    "lion": foreach.make_kernel(foreach.lion, _slots("_momentums")),
    "ftrl": foreach.make_kernel(foreach.ftrl, _slots("_accumulators", "_linears")),
    "lamb": foreach.make_kernel(foreach.lamb, _slots("_momentums", "_velocities")),
}


def fused_update(name):
    """The kernel `(optimizer, grads, variables, learning_rate)` named `name`, or None."""
    return KERNELS.get(name)


def fused_weight_decay():
    """Decoupled weight decay, Keras-on-torch's, one kernel per group (see `adamw`)."""
    return adamw.weight_decay


def fused_scale_update():
    """The plain loss-scale update in torch's `_amp_update_scale_` (see `fused.update_scale`)."""
    return fused.update_scale
