"""The NumPy backend's kernel registry (`backends/numpy/kernels.py`): names, capabilities, hooks.

That each kernel equals its optimizer's `update_step` is tests/backends/numpy/test_fused.py's; here the
registry itself: every name is declared by an optimizer class, every entry
says what it can take, and the other hooks return what the backend has.
"""

import pytest

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.backends.numpy import fused, kernels

DECLARED = {
    cls.update_kernel
    for cls in vars(ls.optimizers).values()
    if isinstance(cls, type) and issubclass(cls, ls.optimizers.Optimizer)
} - {None}


def test_every_name_is_one_an_optimizer_class_declares():
    assert set(kernels.KERNELS) <= DECLARED
    assert sorted(kernels.KERNELS) == ["adam", "sgd"]


def test_fused_update_returns_the_entry_or_none():
    for name, kernel in kernels.KERNELS.items():
        assert kernels.fused_update(name) is kernel
    for name in sorted(DECLARED - set(kernels.KERNELS)) + ["no_such_kernel"]:
        assert kernels.fused_update(name) is None


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_the_kernels_divide_the_scale_out_and_never_see_a_skipped_step(name):
    kernel = kernels.KERNELS[name]
    assert kernel.fn is getattr(fused, name)
    assert kernel.takes_grad_scale and not kernel.folds_keep and not kernel.takes_found_inf


def test_the_other_hooks_are_none_on_numpy():
    assert kernels.fused_weight_decay() is None
    assert kernels.fused_scale_update() is None
    assert kernels.fused_float16_range() is None
    assert get_ops("numpy").fused_update("adam") is kernels.KERNELS["adam"]
