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
    # They divide a grad_scale out as they read the gradients (GradScaler's,
    # or a compiled LossScaleOptimizer's: eagerly it unscales with torch's
    # one-pass AMP kernel instead, `checks_while_unscaling`).
    assert kernel.folds_keep and kernel.takes_found_inf and kernel.takes_grad_scale


def test_eagerly_the_loss_scale_step_unscales_with_the_amp_kernel(monkeypatch):
    ops = ops_for(torch.zeros(()))
    assert ops.checks_while_unscaling()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not ops.checks_while_unscaling()


def test_the_foreach_kernels_fold_the_skip_only():
    for name, kernel in kernels.KERNELS.items():
        if name in ("adam", "sgd"):
            continue
        assert kernel.folds_keep, name
        assert not kernel.takes_grad_scale and not kernel.takes_found_inf, name


def test_the_other_hooks():
    assert kernels.fused_weight_decay() is adamw.weight_decay
    assert kernels.fused_scale_update() is scale_update.update_scale
    assert kernels.fused_float16_range() is float16_range.measure
    assert ops_for(torch.zeros(1)).fused_update("lion") is kernels.KERNELS["lion"]
