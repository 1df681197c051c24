"""The torch backend's kernel registry (`backends/torch/kernels.py`): names, capabilities, hooks.

That each kernel equals its optimizer's `update_step` is tests/backends/torch/test_fused.py's and test_foreach.py's; here the
registry itself: every name is declared by an optimizer class, every entry
says what it can take, and the other hooks return what the backend has.
"""

import pytest
import torch

import lossscale as ls
from lossscale.backends import ops_for
from lossscale.backends.torch import adamw, float16_range, fused, kernels, scale_update

DECLARED = {
    cls.update_kernel
    for cls in vars(ls.optimizers).values()
    if isinstance(cls, type) and issubclass(cls, ls.optimizers.Optimizer)
} - {None}


def test_every_name_is_one_an_optimizer_class_declares():
    assert set(kernels.KERNELS) <= DECLARED
    assert sorted(kernels.KERNELS) == [
        "adadelta",
        "adagrad",
        "adam",
        "adamax",
        "ftrl",
        "lamb",
        "lion",
        "nadam",
        "rmsprop",
        "sgd",
    ]


def test_fused_update_returns_the_entry_or_none():
    for name, kernel in kernels.KERNELS.items():
        assert kernels.fused_update(name) is kernel
    for name in sorted(DECLARED - set(kernels.KERNELS)) + ["no_such_kernel"]:
        assert kernels.fused_update(name) is None


def test_every_optimizer_with_a_kernel_name_has_one_on_torch():
    assert set(kernels.KERNELS) == DECLARED


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_adam_and_sgd_run_on_torchs_fused_kernels_with_its_found_inf(name):
    kernel = kernels.KERNELS[name]
    assert kernel.fn is getattr(fused, name)
    assert kernel.folds_keep and kernel.takes_found_inf
    # They divide GradScaler's grad_scale out, but are not declared to:
    # LossScaleOptimizer's AMP pass divides and checks the gradients at once.
    assert not kernel.takes_grad_scale and kernels.divides_grad_scale(name)


def test_while_tracing_adam_and_sgd_take_the_scale(monkeypatch):
    # Traced, the AMP pass would become a loop writing divided copies of
    # the gradients (tests/optimizers/test_loss_scale_step.py): the kernels
    # divide them as they read them instead. Nothing else changes.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for name, kernel in kernels.KERNELS.items():
        traced = kernels.fused_update(name)
        if name in ("adam", "sgd"):
            assert traced.takes_grad_scale and traced.fn is kernel.fn
            assert (traced.folds_keep, traced.takes_found_inf, traced.folds_weight_decay) == (
                kernel.folds_keep,
                kernel.takes_found_inf,
                kernel.folds_weight_decay,
            )
        else:
            assert traced is kernel


def test_the_foreach_kernels_fold_the_skip_only():
    for name, kernel in kernels.KERNELS.items():
        if name in ("adam", "sgd"):
            continue
        assert kernel.folds_keep, name
        assert not kernel.takes_grad_scale and not kernel.takes_found_inf, name
        assert not kernels.divides_grad_scale(name), name
    assert kernels.GRAD_SCALE_KERNELS == {"adam", "sgd"}


def test_the_other_hooks():
    assert kernels.fused_weight_decay() is adamw.weight_decay
    assert kernels.fused_scale_update() is scale_update.update_scale
    assert kernels.fused_float16_range() is float16_range.measure
    assert ops_for(torch.zeros(1)).fused_update("lion") is kernels.KERNELS["lion"]
