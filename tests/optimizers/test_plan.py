"""`plan.step_plan`: which fast paths a step may take, decided in one place.

A table of settings against a kernel that can do everything, then each
backend's own entries as an optimizer reads them.
"""

import numpy as np
import pytest

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.backends.kernel import Kernel
from lossscale.optimizers.plan import StepPlan, step_plan

CAPABLE = Kernel(lambda *a, **k: None, folds_keep=True, takes_grad_scale=True)
DECAYING = Kernel(lambda *a, **k: None, folds_keep=True, folds_weight_decay=True)
PLAIN = dict(
    weight_decay=None,
    weight_decay_kernel=None,
    loss_scale_factor=None,
    gradient_accumulation_steps=None,
    clips=False,
    use_ema=False,
)


class _Var:
    def __init__(self, overwrite_with_gradient=False, constraint=None):
        self.overwrite_with_gradient = overwrite_with_gradient
        self.constraint = constraint


# (what changes, folds_keep, takes_grad_scale)
ROWS = [
    ({}, True, True),
    ({"weight_decay": 0.1, "weight_decay_kernel": object()}, True, True),
    ({"weight_decay": 0.1}, False, True),  # decay without a kernel: under ops.cond
    ({"weight_decay": 0.0}, False, True),  # 0.0 is a rate, not None
    ({"loss_scale_factor": 8.0}, True, False),
    ({"gradient_accumulation_steps": 2}, False, False),
    ({"clips": True}, True, False),
    ({"use_ema": True}, False, True),
    ({"overwrite": True}, False, False),
    ({"constraint": True}, False, True),
]


@pytest.mark.parametrize("change, folds_keep, takes_grad_scale", ROWS)
def test_each_setting_turns_off_the_fast_paths_it_must(change, folds_keep, takes_grad_scale):
    settings = {**PLAIN, **{k: v for k, v in change.items() if k in PLAIN}}
    variables = [
        _Var(),
        _Var(change.get("overwrite", False), (lambda x: x) if change.get("constraint") else None),
    ]
    plan = step_plan(CAPABLE, variables, **settings)
    assert plan == StepPlan(CAPABLE, folds_keep, takes_grad_scale, False)


def test_without_a_kernel_nothing_is_folded():
    assert step_plan(None, [_Var()], **PLAIN) == StepPlan(None, False, False, False)


def test_a_kernel_that_cannot_is_not_asked_to():
    kernel = Kernel(lambda *a, **k: None)
    assert step_plan(kernel, [_Var()], **PLAIN) == StepPlan(kernel, False, False, False)
    assert step_plan(DECAYING, [_Var()], **PLAIN).folds_weight_decay


def _built(backend, optimizer):
    optimizer.build([ls.Variable(backend.array(np.ones(3)), name="w")])
    return optimizer


# Which rules each backend has a kernel for: (folds_keep, takes_grad_scale),
# or None for none (`update_step` per variable).
KERNELS = {
    "numpy": {"adam": (False, True), "sgd": (False, True), "rmsprop": None},
    "torch": {"adam": (True, True), "sgd": (True, True), "rmsprop": (True, False)},
    "jax": {"adam": (True, True), "sgd": (True, True), "rmsprop": None},
    "tensorflow": {"adam": (True, False), "sgd": (True, False), "rmsprop": (True, False)},
}


@pytest.mark.parametrize("name", ["adam", "sgd", "rmsprop"])
def test_each_backend_plans_its_own_kernels(backend, name):
    cls = {"adam": ls.optimizers.Adam, "sgd": ls.optimizers.SGD, "rmsprop": ls.optimizers.RMSprop}
    opt = _built(backend, cls[name](0.1))
    plan = opt._step_plan(opt._trainable_variables)
    expected = KERNELS[backend.name][name]
    if expected is None:
        assert plan.kernel is None and not plan.folds_keep
    else:
        assert plan.kernel is get_ops(backend.name).fused_update(name)
        assert (plan.folds_keep, plan.takes_grad_scale) == expected


class _MySGD(ls.optimizers.SGD):
    """A user's rule: its own `update_step`, no kernel name of its own."""

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_sub(gradient * learning_rate * 2)


def test_tensorflow_traces_a_users_rule_without_a_name_list():
    import tensorflow  # noqa: F401 - left out where TensorFlow is not installed

    from tests.conftest import Backend

    opt = _built(Backend("tensorflow"), _MySGD(0.5))
    plan = opt._step_plan(opt._trainable_variables)
    assert plan.kernel is not None and plan.folds_keep
    w = opt._trainable_variables[0]
    opt.apply([tensorflow.ones(3)], [w])
    np.testing.assert_array_equal(w.numpy(), np.zeros(3, np.float32))  # its own rule, traced


def test_elsewhere_a_users_rule_runs_update_step_per_variable(backend):
    opt = _built(backend, _MySGD(0.5))
    plan = opt._step_plan(opt._trainable_variables)
    # TensorFlow traces it (above); the others run its `update_step` as it is.
    assert (plan.kernel is not None) is (backend.name == "tensorflow")
