"""`wrap_native`: native optimizers get their adapter, everything else passes through."""

import doctest
import subprocess
import sys

import optax
import torch

import lossscale as ls
from lossscale.optimizers import native
from lossscale.optimizers.native import wrap_native
from lossscale.optimizers.optax_native import OptaxOptimizer
from lossscale.optimizers.torch_native import TorchOptimizer


def test_native_optimizers_get_their_adapter():
    w = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([w], lr=0.1)
    wrapped = wrap_native(sgd)
    assert isinstance(wrapped, TorchOptimizer) and wrapped.optimizer is sgd
    adam = optax.adam(0.1)
    wrapped = wrap_native(adam)
    assert isinstance(wrapped, OptaxOptimizer) and wrapped.transformation is adam


def test_other_objects_pass_through():
    ours = ls.optimizers.SGD(0.1)
    adapter = OptaxOptimizer(optax.sgd(0.1))
    for obj in (ours, adapter, "adam", None):
        assert wrap_native(obj) is obj


def test_an_unloaded_library_is_not_imported():
    code = ("import sys; from lossscale.optimizers.native import wrap_native; "
            "wrap_native(object()); "
            "print(sorted(m for m in ('torch', 'jax', 'optax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_docstring_example():
    result = doctest.testmod(native, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
