"""torch_ops: masked `cond` and writes, device constants, torch.compile, and the
no-synchronisation guarantee of a whole step."""

import numpy as np
import pytest
import torch
from torch_cases import SHAPES, apply, inject, no_host_reads, random_grads

import lossscale as ls
import lossscale.backends.torch as torch_backend
from lossscale.backends.torch import fused as torch_fused
from lossscale.backends.torch import kernels as torch_kernels
from lossscale.backends.torch import ops as torch_ops
from lossscale.optimizers import SGD, Adam, RMSprop


def storage(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# --- masked execution ----------------------------------------------------------


@pytest.mark.parametrize("taken", [True, False])
def test_cond_on_tensor_runs_both_branches_under_masks(taken):
    x = storage([1.0, 2.0])
    seen = []

    def true_fn():
        seen.append(("true", torch_ops.active_mask().clone()))
        torch_ops.assign(x, storage([10.0, 20.0]))

    def false_fn():
        seen.append(("false", torch_ops.active_mask().clone()))
        torch_ops.assign_add(x, 100.0)

    torch_ops.cond(torch.tensor(taken), true_fn, false_fn, [])
    assert [(b, bool(m)) for b, m in seen] == [("true", taken), ("false", not taken)]
    expected = [10.0, 20.0] if taken else [101.0, 102.0]
    assert x.tolist() == expected
    assert torch_ops.active_mask() is None


@pytest.mark.parametrize("pred", [True, False, np.bool_(True), np.bool_(False)])
def test_cond_on_host_boolean_is_a_plain_if(pred):
    calls = []
    torch_ops.cond(pred, lambda: calls.append("true"), lambda: calls.append("false"), [])
    assert calls == (["true"] if pred else ["false"])


@pytest.mark.parametrize("outer", [True, False])
@pytest.mark.parametrize("inner", [True, False])
def test_nested_conds_combine_masks(outer, inner):
    x = storage([0.0])

    def outer_true():
        torch_ops.cond(
            torch.tensor(inner),
            lambda: torch_ops.assign_add(x, 1.0),
            lambda: torch_ops.assign_add(x, 2.0),
            [],
        )

    torch_ops.cond(torch.tensor(outer), outer_true, lambda: torch_ops.assign_add(x, 4.0), [])
    expected = (1.0 if inner else 2.0) if outer else 4.0
    assert x.tolist() == [expected]


def test_masked_writes_never_store_values_of_the_branch_not_taken():
    x = storage([1.0, -0.0, 3.0])
    before = x.clone()
    with torch_ops.masked(torch.tensor(False)):
        torch_ops.assign(x, storage([np.nan, np.inf, -np.inf]))
        torch_ops.assign_add(x, storage([np.nan, 1.0, 1.0]))
        torch_ops.assign_sub(x, np.inf)
        torch_ops.assign(x, 7.0)
    # Bit for bit, including the sign of zero.
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))


def test_masked_writes_equal_plain_writes_when_taken():
    rng = np.random.default_rng(0)
    a, b = storage(rng.normal(size=5)), storage(rng.normal(size=5))
    plain, masked = a.clone(), a.clone()
    for op in (torch_ops.assign_add, torch_ops.assign_sub, torch_ops.assign):
        op(plain, b)
        with torch_ops.masked(torch.tensor(True)):
            op(masked, b)
        assert torch.equal(plain, masked)


def test_masked_write_broadcasts_and_casts_like_a_plain_one():
    half = torch.zeros(2, 3, dtype=torch.float16)
    with torch_ops.masked(torch.tensor(True)):
        torch_ops.assign_add(half, storage([1.0, 2.0, 3.0]))
    assert half.dtype == torch.float16 and half.tolist() == [[1.0, 2.0, 3.0]] * 2
    counter = torch.zeros((), dtype=torch.int64)
    with torch_ops.masked(torch.tensor(True)):
        torch_ops.assign_add(counter, 1)
    assert counter.dtype == torch.int64 and int(counter) == 1


def test_masked_write_into_parameter_keeps_autograd_state():
    p = torch.nn.Parameter(storage([1.0, 2.0]))
    with torch_ops.masked(torch.tensor(True)):
        torch_ops.assign_sub(p, storage([0.5, 0.5]))
    assert p.requires_grad and p.grad_fn is None and p.tolist() == [0.5, 1.5]


@pytest.mark.parametrize(
    "make",
    [lambda: SGD(0.1, momentum=0.9), lambda: Adam(0.01), lambda: RMSprop(0.01, centered=True)],
)
def test_masked_step_equals_python_if_step(monkeypatch, make):
    """A LossScaleOptimizer step under masks gives the results of a host-side `if`."""

    def host_cond(pred, true_fn, false_fn, variables):
        true_fn() if bool(pred) else false_fn()

    runs = []
    for cond in (torch_ops.cond, host_cond):
        monkeypatch.setattr(torch_ops, "cond", cond)
        rng = np.random.default_rng(1)
        params = [torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in SHAPES]
        opt = ls.LossScaleOptimizer(make(), initial_scale=4.0, dynamic_growth_steps=2)
        for kind in ["f", "inf", "f", "nan", "nan", "f", "f", "f"]:
            grads = inject(random_grads(rng, 4.0), kind)
            apply(opt, [torch.tensor(g) for g in grads], params)
        runs.append([p.clone() for p in params] + [v.value.clone() for v in opt.variables])
    for masked, plain in zip(*runs):
        assert torch.equal(masked, plain)


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


# --- the loss-scale update kernel -------------------------------------------------


@pytest.mark.parametrize(
    "initial,growth,backoff,steps",
    [
        (2.0**15, 2.0, 0.5, 3),
        (1.0, 4.0, 0.25, 2),
        (2.0**126, 2.0, 0.5, 1),  # growth past float32's range is not taken
        (4 * float(np.finfo(np.float32).tiny), 2.0, 0.5, 4),  # backoff stops at the floor
        (1e-40, 2.0, 0.5, 3),  # a scale below the floor only moves up to it on overflow
    ],
)
def test_fused_scale_update_equals_the_generic_selects(
    monkeypatch, initial, growth, backoff, steps
):
    from lossscale.mixed_precision import LossScalePolicy, LossScaleState, next_loss_scale

    policy = LossScalePolicy(2.0**15, steps, growth_factor=growth, backoff_factor=backoff)
    assert policy.is_plain
    pattern = np.random.default_rng(7).random(60) < 0.8
    calls = []

    def run(kernel, counter_dtype):
        monkeypatch.setattr(torch_backend, "fused_scale_update", lambda: kernel)
        state = LossScaleState(
            torch.tensor(initial, dtype=torch.float32), torch.tensor(0, dtype=counter_dtype)
        )
        trail = []
        for finite in pattern:
            state = next_loss_scale(torch_backend, state, torch.tensor(bool(finite)), policy)
            trail.append(
                (state.scale.item(), state.counter.item(), state.scale.dtype, state.counter.dtype)
            )
        return trail

    def counting(*args):
        calls.append(1)
        return torch_fused.update_scale(*args)

    generic = run(None, torch.int32)
    assert run(counting, torch.int32) == generic and len(calls) == len(pattern)
    assert [t[:2] for t in run(counting, torch.int64)] == [t[:2] for t in generic]
    assert run(counting, torch.int64)[-1][3] == torch.int64  # the state keeps its dtypes


def test_fused_scale_update_reads_nothing_on_the_host():
    scale, counter = torch.tensor(8.0), torch.tensor(1, dtype=torch.int32)
    with no_host_reads():
        new_scale, new_counter = torch_kernels.fused_scale_update()(
            scale, counter, torch.tensor(True), 2, 2.0, 0.5, 1e-38
        )
    assert (float(new_scale), int(new_counter)) == (16.0, 0)
    assert (float(scale), int(counter)) == (8.0, 1)  # inputs untouched
