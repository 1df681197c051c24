"""backends/torch/ops.py: device constants, torch.compile, and the
no-synchronisation guarantee of a whole step (masked branches:
tests/backends/torch/test_control.py)."""

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends.torch import ops as torch_ops
from lossscale.optimizers import SGD, Adam, RMSprop
from tests.torch_cases import no_host_reads


def storage(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def test_constants_are_made_once_per_value_dtype_and_device():
    a = torch_ops.constant(0.5, torch.float32, torch.device("cpu"))
    assert torch_ops.constant(0.5, torch.float32, torch.device("cpu")) is a
    assert torch_ops.constant(0.5, torch.float16, torch.device("cpu")) is not a
    negative_zero = torch_ops.constant(-0.0, torch.float32, torch.device("cpu"))
    assert negative_zero is not torch_ops.constant(0.0, torch.float32, torch.device("cpu"))
    assert torch.signbit(negative_zero)
    x = storage([1.0, 2.0], torch.float16)
    assert torch.equal(torch_ops.maximum(x, 1.5), torch.tensor([1.5, 2.0], dtype=torch.float16))


# --- no synchronisation -------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [lambda: Adam(1e-3), lambda: SGD(0.1, momentum=0.9), lambda: RMSprop(1e-3, centered=True)],
    ids=["adam", "sgd", "rmsprop"],
)
def test_step_reads_nothing_on_the_host(make):
    """Structurally: no tensor value is read by Python during `apply`."""
    rng = np.random.default_rng(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    opt = ls.LossScaleOptimizer(make(), initial_scale=8.0, dynamic_growth_steps=2)
    opt.scale_loss(torch.ones(()))

    def grads(kind):
        g = [torch.tensor(rng.normal(size=tuple(p.shape)) * 8, dtype=torch.float32) for p in params]
        if kind != "f":
            g[kind == "nan"].view(-1)[0] = np.inf if kind == "inf" else np.nan
        return g

    opt.apply(grads("f"), params)  # builds: creating variables may copy from the host
    with no_host_reads():
        for kind in ["f", "inf", "f", "nan", "f", "f"]:
            opt.scale_loss(torch.ones(()))
            opt.apply(grads(kind), params)
    assert int(opt.iterations) == 5 and float(opt.dynamic_scale) == 8.0  # 8 16 8 . 4 . 8


def test_no_host_reads_guard_catches_a_read():
    with pytest.raises(AssertionError, match=r"Tensor.item called during a step"):
        with no_host_reads():
            torch.ones(()).item()
    with pytest.raises(AssertionError, match=r"Tensor.__bool__ called during a step"):
        with no_host_reads():
            bool(torch.ones(()))
    assert torch.ones(()).item() == 1.0


def cuda_step_does_not_synchronize(make):
    """On a GPU, torch itself reports any synchronising call as an error.

    A GPU check, not collected on machines without CUDA (CI has none, and a
    skipped test would read as a missing feature); on such machines the
    structural test above guards the same property.
    """
    device = torch.device("cuda")
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)
    ).to(device)
    params = list(model.parameters())
    opt = ls.LossScaleOptimizer(make(), initial_scale=8.0, dynamic_growth_steps=2)
    x = torch.randn(16, 64, device=device)

    def step(poison):
        loss = model(x).square().mean()
        grads = torch.autograd.grad(opt.scale_loss(loss), params)
        if poison:
            grads[0].view(-1)[:1].fill_(float("inf"))
        opt.apply(grads, params)

    step(False)  # builds
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in params]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for poison in [False, True, False, False, True, False]:
            step(poison)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert int(opt.iterations) == 5
    assert not all(torch.equal(b, p) for b, p in zip(before, params))


if torch.cuda.is_available():
    test_cuda_step_does_not_synchronize = pytest.mark.parametrize(
        "make",
        [lambda: Adam(1e-3), lambda: SGD(0.1, momentum=0.9), lambda: RMSprop(1e-3, centered=True)],
        ids=["adam", "sgd", "rmsprop"],
    )(cuda_step_does_not_synchronize)


# --- torch.compile ----------------------------------------------------------------


def test_compiled_training_step_matches_eager():
    """A compiled step that calls `apply` runs (graph breaks allowed) and agrees."""

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = ls.LossScaleOptimizer(Adam(1e-2), initial_scale=2.0**8, dynamic_growth_steps=3)
        opt.build(list(model.parameters()))
        return model, opt

    def make_step(model, opt):
        params = list(model.parameters())

        def step(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            opt.apply(torch.autograd.grad(opt.scale_loss(loss), params), params)
            return loss.detach()

        return step

    x, y = torch.randn(16, 6), torch.randn(16, 1)
    results = []
    for compiled in (False, True):
        model, opt = setup()
        step = make_step(model, opt)
        if compiled:
            torch._dynamo.reset()
            step = torch.compile(step, backend="aot_eager")
        losses = [step(x, y) for _ in range(4)]
        results.append(
            (losses, [p.detach().clone() for p in model.parameters()], int(opt.iterations))
        )
    (eager_losses, eager_params, eager_steps), (losses, params, steps) = results
    assert steps == eager_steps == 4
    torch.testing.assert_close(losses, eager_losses)
    torch.testing.assert_close(params, eager_params)


def test_the_constant_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(torch_ops, "_CONSTANTS", {})
    monkeypatch.setattr(torch_ops, "_CONSTANTS_KEPT", 3)
    cpu = torch.device("cpu")
    first = torch_ops.constant(0.25, torch.float32, cpu)
    for value in (0.5, 0.75, 1.25):
        torch_ops.constant(value, torch.float32, cpu)
    assert len(torch_ops._CONSTANTS) == 3
    assert torch_ops.constant(0.25, torch.float32, cpu) is not first  # dropped, made anew
    assert float(torch_ops.constant((0.9, 0.99), torch.float32, cpu)[1]) == pytest.approx(0.99)


@pytest.mark.parametrize(
    "write, on_ones, on_zeros",
    [("assign", 2.0, 2.0), ("assign_add", 3.0, 2.0), ("assign_sub", -1.0, -2.0)],
)
def test_writes_record_no_autograd_history_with_or_without_no_grad(write, on_ones, on_zeros):
    # `no_grad` is entered only where autograd would record the write: into
    # a parameter, or of a value that requires grad. Plain state is written
    # directly (the context costs about as much as a 0-d write).
    value = torch.full((3,), 2.0, requires_grad=True)
    param = torch.nn.Parameter(torch.ones(3))
    getattr(torch_ops, write)(param, value)
    assert param.is_leaf and param.requires_grad and param.grad_fn is None
    assert param.detach().tolist() == [on_ones] * 3
    for given in (value, value.detach(), 2.0):
        state = torch.zeros(3)
        getattr(torch_ops, write)(state, given)
        assert state.grad_fn is None and not state.requires_grad
        assert state.tolist() == [on_zeros] * 3
    with torch.no_grad():  # already off: written directly
        getattr(torch_ops, write)(param, 2.0)
    assert param.is_leaf and param.grad_fn is None
