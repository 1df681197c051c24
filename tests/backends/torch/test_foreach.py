"""torch_foreach: every multi-tensor rule equals its optimizer's `update_step`."""

import numpy as np
import pytest
import torch

from lossscale.backends.torch import foreach as torch_foreach
from lossscale.backends.torch import kernels as torch_kernels
from lossscale.optimizers import SGD
from tests.torch_cases import OPTIMIZERS, assert_same_run, generic_path, train

FOREACH = [
    "rmsprop",
    "rmsprop_centered_momentum",
    "adagrad",
    "adadelta",
    "adamax",
    "nadam",
    "lion",
    "ftrl",
    "lamb",
]


def test_every_optimizer_has_a_kernel():
    for name, make in OPTIMIZERS.items():
        assert torch_kernels.fused_update(make().update_kernel) is not None, name


@pytest.mark.parametrize("name", FOREACH)
@pytest.mark.parametrize("wrap", [True, False], ids=["loss_scaled", "bare"])
def test_foreach_rule_equals_generic_path(monkeypatch, name, wrap):
    pattern = None if wrap else ["f"] * 5  # unwrapped, a NaN would stay in the weights
    kwargs = {"wrap": wrap} if wrap else {"wrap": False, "pattern": pattern}
    fast = train(OPTIMIZERS[name](), **kwargs)
    generic_path(monkeypatch, OPTIMIZERS[name]())
    generic = train(OPTIMIZERS[name](), **kwargs)
    assert_same_run(fast, generic)


@pytest.mark.parametrize(
    "name", FOREACH + ["sgd", "sgd_momentum", "sgd_nesterov", "adam", "adam_amsgrad", "adamw"]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=["float16", "float64"])
def test_rules_equal_generic_path_in_other_dtypes(monkeypatch, name, dtype):
    """Half-precision parameters take the foreach rules, which round like `update_step`."""
    fast = train(OPTIMIZERS[name](), dtype=dtype)
    generic_path(monkeypatch, OPTIMIZERS[name]())
    generic = train(OPTIMIZERS[name](), dtype=dtype)
    if dtype == torch.float16:
        assert_same_run(fast, generic, rtol=0, atol=0)  # identical, bit for bit
    else:
        assert_same_run(fast, generic, rtol=1e-12, atol=1e-14)


def test_kernels_group_parameters_by_dtype(monkeypatch):
    rng = np.random.default_rng(3)
    dtypes = [torch.float32, torch.float16, torch.float32, torch.float64]

    def run():
        params = [torch.tensor(rng.normal(size=(4,)), dtype=d) for d in dtypes]
        opt = SGD(0.1, momentum=0.9)
        for _ in range(3):
            opt.apply([torch.tensor(rng.normal(size=(4,)), dtype=d) for d in dtypes], params)
        return params

    fast = run()
    rng = np.random.default_rng(3)
    generic_path(monkeypatch, SGD())
    generic = run()
    for a, b in zip(fast, generic):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a.double().numpy(), b.double().numpy(), rtol=1e-5)


def test_scalar_places_numbers_and_tensors_on_the_group():
    class Group:
        dtype, device = torch.float16, torch.device("cpu")

    s = torch_foreach.scalar(0.1, Group)
    assert s.dtype == torch.float16 and s is torch_foreach.scalar(0.1, Group)
    t = torch_foreach.scalar(torch.tensor(0.1, dtype=torch.float64), Group)
    assert t.dtype == torch.float16 and float(t) == float(s)


def fast_path_on_cuda_equals_generic_path_on_cpu(monkeypatch, name, device="cuda"):
    """Every kernel on a GPU (fused or `_foreach_*`) against `update_step` on the CPU.

    A GPU check, collected only where CUDA exists (CI has none, and a skipped
    test would read as a missing feature). `device` lets the CPU suite run
    the same function, so the check itself is exercised everywhere.
    """
    fast = train(OPTIMIZERS[name](), device=device)
    generic_path(monkeypatch, OPTIMIZERS[name]())
    generic = train(OPTIMIZERS[name]())
    assert_same_run(fast, generic)


def test_the_cuda_check_runs_on_cpu(monkeypatch):
    fast_path_on_cuda_equals_generic_path_on_cpu(monkeypatch, "adam", device="cpu")


if torch.cuda.is_available():
    test_fast_path_on_cuda_equals_generic_path_on_cpu = pytest.mark.parametrize(
        "name", list(OPTIMIZERS)
    )(fast_path_on_cuda_equals_generic_path_on_cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("op", ["mul", "div"])
def test_products_by_numbers_equal_torchs_bit_for_bit(dtype, op):
    # float32 lists take the number as a cached 0-d tensor (torch's CPU
    # kernels wrap a number anew for every tensor); the values must not move.
    rng = np.random.default_rng(8)
    tensors = [
        torch.tensor(rng.normal(size=s) * 10.0 ** rng.integers(-4, 4, size=s), dtype=dtype)
        for s in [(3,), (1000,), (17, 33), (1,)]
    ]
    ours, theirs = getattr(torch_foreach, op), getattr(torch, f"_foreach_{op}")
    for number in [0.9, 1 - 0.999, 0.0371, 3, -2.5e-3]:
        for a, b in zip(ours(tensors, number), theirs(tensors, number)):
            assert a.dtype == dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    operand = torch_foreach._operand(tensors, 0.9)
    assert isinstance(operand, torch.Tensor) == (dtype == torch.float32)
