"""Shared helpers of the torch fast-path tests: optimizer table, runs, no-sync guard."""

import contextlib
import warnings

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends.torch import kernels as torch_kernels
from lossscale.mixed_precision import UnscaledLossWarning
from lossscale.optimizers import (
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    Ftrl,
    Lamb,
    Lion,
    Nadam,
    RMSprop,
)

SHAPES = [(3, 4), (5,), (), (2, 3, 2)]

# Every optimizer with a torch kernel, in the settings that change the kernel.
OPTIMIZERS = {
    "sgd": lambda: SGD(0.1),
    "sgd_momentum": lambda: SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: Adam(0.01),
    "adam_amsgrad": lambda: Adam(0.01, amsgrad=True),
    "adamw": lambda: AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: RMSprop(0.01),
    "rmsprop_centered_momentum": lambda: RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: Adagrad(0.1),
    "adadelta": lambda: Adadelta(1.0),
    "adamax": lambda: Adamax(0.01),
    "nadam": lambda: Nadam(0.01),
    "lion": lambda: Lion(0.01),
    "ftrl": lambda: Ftrl(
        0.1,
        l1_regularization_strength=0.01,
        l2_regularization_strength=0.01,
        l2_shrinkage_regularization_strength=0.01,
    ),
    "lamb": lambda: Lamb(0.01),
}

# Steps of a run: "f" finite, "inf" / "nan" one such value in one gradient.
PATTERN = ["f", "f", "inf", "f", "nan", "f", "f"]


def generic_path(monkeypatch, optimizer):
    """Removes the kernel of `type(optimizer)`, forcing the per-variable `update_step`."""
    assert torch_kernels.fused_update(type(optimizer).update_kernel) is not None
    monkeypatch.delitem(torch_kernels.KERNELS, type(optimizer).update_kernel)


def random_grads(rng, scale=1.0, shapes=SHAPES):
    return [(scale * rng.normal(size=s)).astype(np.float32) for s in shapes]


def inject(grads, kind):
    if kind != "f":
        grads[1][0] = np.inf if kind == "inf" else np.nan
    return grads


def train(
    optimizer,
    *,
    dtype=torch.float32,
    grad_dtype=None,
    wrap=True,
    pattern=PATTERN,
    seed=0,
    initial_scale=8.0,
    device="cpu",
):
    """Runs `pattern` through `optimizer` (in a LossScaleOptimizer when `wrap`).

    Returns the parameters and every optimizer variable, as float64 arrays.
    """
    rng = np.random.default_rng(seed)
    params = [torch.tensor(rng.normal(size=s), dtype=dtype, device=device) for s in SHAPES]
    opt = (
        ls.LossScaleOptimizer(optimizer, initial_scale=initial_scale, dynamic_growth_steps=2)
        if wrap
        else optimizer
    )
    scale = initial_scale if wrap else 1.0
    for kind in pattern:
        grads = inject(random_grads(rng, scale), kind)
        apply(
            opt, [torch.tensor(g, dtype=grad_dtype or dtype, device=device) for g in grads], params
        )
    return (
        [p.double().cpu().numpy() for p in params],
        [torch.as_tensor(v.value).double().cpu().numpy() for v in opt.variables],
    )


def apply(opt, grads, params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnscaledLossWarning)
        opt.apply(grads, params)


def assert_same_run(fast, generic, rtol=1e-5, atol=1e-6):
    for a, b in zip(fast[0] + fast[1], generic[0] + generic[1]):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@contextlib.contextmanager
def no_host_reads():
    """Makes every way of reading a tensor's value on the host raise.

    The step then runs as on a GPU: the one read a CPU step makes on
    purpose (its scale, which waits for nothing there,
    `backends/torch/multi.HOST_READABLE`) is off.
    """
    from lossscale.backends.torch import multi

    names = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def forbidden(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} called during a step (a host read)")

        return read

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(multi, "HOST_READABLE", frozenset())
        for name in names:
            mp.setattr(torch.Tensor, name, forbidden(name))
        yield
    finally:
        mp.undo()
        assert all(getattr(torch.Tensor, n) is f for n, f in saved.items())


@contextlib.contextmanager
def count_ops():
    """Records the name of every aten operation dispatched inside the block.

    On a GPU each is a kernel launch (views and scalar ops included), so the
    count is what a launch-bound step pays; it is deterministic.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recorder():
        yield seen
