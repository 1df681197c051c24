"""`Kernel`: a registered update kernel, its capabilities, and the call it forwards."""

import dataclasses

import pytest

from lossscale.backends.kernel import Kernel


def test_capabilities_default_to_false():
    kernel = Kernel(print)
    assert (kernel.folds_keep, kernel.takes_grad_scale, kernel.takes_found_inf) == (
        False,
        False,
        False,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        kernel.folds_keep = True


def test_a_call_forwards_every_argument_unchanged():
    calls = []

    def fn(params, grads, slots, hyper, **kwargs):
        calls.append((params, grads, slots, hyper, kwargs))
        return "result"

    kernel = Kernel(fn, folds_keep=True)
    params, grads, slots, hyper = ["p"], ["g"], {"m": ["m0"]}, ("h",)
    keep = object()
    assert kernel(params, grads, slots, hyper, iterations=3, lr=0.5, rule=None, keep=keep) == (
        "result"
    )
    [(p, g, s, h, kwargs)] = calls
    assert p is params and g is grads and s is slots and h is hyper
    assert kwargs == {"iterations": 3, "lr": 0.5, "rule": None, "keep": keep}
    assert kwargs["keep"] is keep


def test_kernels_compare_by_function_and_capabilities():
    assert Kernel(print, folds_keep=True) == Kernel(print, folds_keep=True)
    assert Kernel(print) != Kernel(print, takes_found_inf=True)
    assert hash(Kernel(print)) == hash(Kernel(print))
