"""torch_fused: Adam, AdamW and SGD on torch's fused kernels equal `update_step`."""

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends.torch import fused as torch_fused
from lossscale.backends.torch import kernels as torch_kernels
from lossscale.backends.torch import scale_update
from lossscale.optimizers import SGD, Adam, AdamW
from lossscale.schedules import ExponentialDecay
from tests.torch_cases import (
    OPTIMIZERS,
    SHAPES,
    apply,
    assert_same_run,
    generic_path,
    inject,
    random_grads,
    train,
)

FUSED = ["sgd", "sgd_momentum", "sgd_nesterov", "adam", "adam_amsgrad", "adamw"]


def test_table_entries():
    kernel = torch_kernels.fused_update
    assert kernel(Adam.update_kernel).fn is torch_fused.adam
    assert kernel(AdamW.update_kernel).fn is torch_fused.adam
    assert kernel(SGD.update_kernel).fn is torch_fused.sgd
    assert kernel("adam").folds_keep and kernel("adam").takes_grad_scale
    assert torch_kernels.fused_scale_update() is scale_update.update_scale


@pytest.mark.parametrize("name", FUSED)
def test_fused_kernel_equals_generic_path(monkeypatch, name):
    """Random data, inf and NaN steps inside a LossScaleOptimizer: 1e-5 relative."""
    fast = train(OPTIMIZERS[name](), pattern=["f", "f", "inf", "f", "nan", "f", "f", "f", "f"])
    generic_path(monkeypatch, OPTIMIZERS[name]())
    generic = train(OPTIMIZERS[name](), pattern=["f", "f", "inf", "f", "nan", "f", "f", "f", "f"])
    assert_same_run(fast, generic)


@pytest.mark.parametrize("name", FUSED)
def test_skipped_step_leaves_everything_bit_for_bit(name):
    rng = np.random.default_rng(5)
    params = [torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in SHAPES]
    opt = ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=8.0)
    apply(opt, [torch.tensor(g) for g in random_grads(rng, 8.0)], params)
    # Zeros of both signs, where a skipped weight decay must add a zero of
    # the parameter's own sign.
    params[0].view(-1)[:2] = torch.tensor([-0.0, 0.0])
    state = [p.clone() for p in params] + [v.value.clone() for v in opt.inner_optimizer.variables]
    for kind in ("inf", "nan"):
        apply(opt, [torch.tensor(g) for g in inject(random_grads(rng, 8.0), kind)], params)
        after = params + [v.value for v in opt.inner_optimizer.variables]
        for b, a in zip(state, after):
            assert torch.equal(bits(b), bits(a))


def bits(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_follows_keras_when_the_learning_rate_changes(monkeypatch, nesterov):
    """torch keeps `buf = momentum * buf + g`; the kernel still keeps Keras's `m`."""

    def make():
        schedule = ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
        return SGD(schedule, momentum=0.9, nesterov=nesterov)

    fast = train(make(), wrap=False, pattern=["f"] * 6)
    generic_path(monkeypatch, make())
    generic = train(make(), wrap=False, pattern=["f"] * 6)
    assert_same_run(fast, generic)


def test_adam_fused_matches_float64_keras_formula():
    rng = np.random.default_rng(2)
    w0 = rng.normal(size=(7,))
    w = torch.tensor(w0, dtype=torch.float32)
    opt = Adam(0.01)
    ref, m, v = w0.copy(), np.zeros(7), np.zeros(7)
    for t in range(1, 6):
        g = rng.normal(size=(7,))
        opt.apply([torch.tensor(g, dtype=torch.float32)], [w])
        m += (g - m) * 0.1
        v += (g * g - v) * 0.001
        ref -= m * (0.01 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)) / (np.sqrt(v) + 1e-7)
    np.testing.assert_allclose(w.numpy(), ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "rmsprop", "lamb"])
def test_float32_parameters_with_half_gradients(monkeypatch, name, grad_dtype):
    """Gradients are unscaled in float32, then the float32 kernels take them."""
    fast = train(OPTIMIZERS[name](), grad_dtype=grad_dtype)
    generic_path(monkeypatch, OPTIMIZERS[name]())
    generic = train(OPTIMIZERS[name](), grad_dtype=grad_dtype)
    assert_same_run(fast, generic)


def test_half_gradients_without_loss_scaling_are_cast_per_group(monkeypatch):
    fast = train(Adam(0.01), grad_dtype=torch.float16, wrap=False, pattern=["f"] * 4)
    generic_path(monkeypatch, Adam())
    generic = train(Adam(0.01), grad_dtype=torch.float16, wrap=False, pattern=["f"] * 4)
    assert_same_run(fast, generic)


def test_nn_module_updated_in_place_by_fused_kernel():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    params = list(model.parameters())
    ids = [id(p) for p in params]
    opt = ls.LossScaleOptimizer(Adam(0.05), initial_scale=16.0)
    x, y = torch.randn(8, 5), torch.randn(8, 1)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        opt.apply(torch.autograd.grad(opt.scale_loss(loss), params), params)
    assert [id(p) for p in model.parameters()] == ids
    assert all(
        isinstance(p, torch.nn.Parameter) and p.requires_grad and p.grad_fn is None
        for p in model.parameters()
    )
    assert losses[-1] < losses[0] / 2
    model(x).sum().backward()  # autograd still works on the updated parameters
    assert all(p.grad is not None for p in params)


def test_float16_parameters_train_under_autocast_scale(monkeypatch):
    """Pure float16 weights: the update runs in float16, as `update_step` does."""
    fast = train(Adam(0.01), dtype=torch.float16, pattern=["f", "inf", "f", "f"])
    generic_path(monkeypatch, Adam())
    generic = train(Adam(0.01), dtype=torch.float16, pattern=["f", "inf", "f", "f"])
    assert_same_run(fast, generic, rtol=0, atol=0)


def test_gradients_of_an_autograd_graph_are_not_unscaled_in_place():
    # A gradient penalty keeps the gradients in the graph (create_graph=True):
    # dividing them in place inside the kernel would break its backward and
    # change the caller's tensors. The wrapper's step must equal the one on
    # detached copies, and leave the graph usable.
    torch.manual_seed(0)
    init = [torch.randn(5, 3), torch.randn(3)]
    results = []
    for in_graph in (True, False):
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = ls.LossScaleOptimizer(Adam(0.01), initial_scale=64.0)
        x = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
        loss = opt.scale_loss(((x @ params[0] + params[1]) ** 2).mean())
        grads = torch.autograd.grad(loss, params, create_graph=in_graph)
        if in_graph:
            assert all(g.requires_grad for g in grads)
            penalty = sum((g**2).sum() for g in grads)  # saves the gradients
            before = [g.detach().clone() for g in grads]
        opt.apply(list(grads), params)
        if in_graph:
            for g, b in zip(grads, before):
                assert torch.equal(g.detach(), b)  # still the scaled gradients
            penalty.backward()  # fails if a saved gradient was written in place
        results.append([p.detach().clone() for p in params] + [v.value for v in opt.variables])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adam_step_size_equals_update_steps_bit_for_bit(dtype):
    # Both powers in one `pow` of a pair, the count cast as it is stored:
    # the same float operations as `Adam.update_step`'s scalars.
    from lossscale.backends import get_ops
    from lossscale.backends.torch import plans
    from lossscale.optimizers import moments

    params = [ls.Variable(torch.ones(3, dtype=dtype))]
    opt = Adam(0.003, beta_1=0.87, beta_2=0.9999999)  # beta_2**t still moves at 2**24
    opt.build(params)
    group = plans.plan(params, {}, {}).groups[0]
    ops = get_ops("torch")
    for iterations in [0, 1, 2, 9, 100, 12345, 2**24 + 1]:
        opt.iterations.assign(iterations)
        lr = ops.cast(opt.learning_rate, str(dtype).removeprefix("torch."))
        b1, b2 = moments.powers_at_step(opt, str(dtype).removeprefix("torch."), 0.87, 0.9999999)
        expected = lr * ops.sqrt(1 - b2) / (1 - b1)
        hyper = opt._hyper_type(*(getattr(opt, k) for k in opt._hyper_type._fields))
        got = torch_fused._adam_step_size(hyper, group, lr, opt.iterations)
        assert got.dtype == dtype and torch.equal(got, expected), iterations


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("keep", [None, True, False], ids=["plain", "kept", "skipped"])
@pytest.mark.parametrize("name", FUSED)
def test_a_grad_scale_is_divided_out_as_an_unscale_pass_would_bit_for_bit(name, keep, dtype):
    # The scale is not a power of two: the kernel divides, it does not
    # multiply by an inverse. float16 parameters take the foreach rules,
    # which get gradients divided first, as `ops.unscale` divides them.
    from lossscale.backends.torch import multi

    rng = np.random.default_rng(7)
    start = [rng.normal(size=s) for s in SHAPES]
    scale = torch.tensor(3.7)
    scaled = [torch.tensor(g, dtype=dtype) for g in random_grads(rng, 3.7)]
    keep = None if keep is None else torch.tensor(keep)
    runs = []
    for fold in (True, False):
        params = [ls.Variable(torch.tensor(v, dtype=dtype)) for v in start]
        opt = OPTIMIZERS[name]()
        opt.build(params)
        for _ in range(3):
            grads = [g.clone() for g in scaled]
            if fold:
                opt._step(grads, params, keep=keep, grad_scale=scale)
            else:
                grads = multi.unscale(grads, scale, in_place=True)
                opt._step(grads, params, keep=keep)
        runs.append(([p.value for p in params] + [v.value for v in opt.variables], grads))
    (folded, folded_grads), (divided, divided_grads) = runs
    for a, b in zip(folded, divided):
        assert torch.equal(bits(a), bits(b))
    if keep is None and dtype != torch.float16:  # written back unscaled, as torch's fused kernels
        for a, b in zip(folded_grads, divided_grads):
            assert torch.equal(bits(a), bits(b))


def test_the_kernels_that_divide_a_grad_scale():
    taking = {n for n, k in torch_kernels.KERNELS.items() if k.takes_grad_scale}
    assert taking == {"adam", "sgd"} and torch_kernels.fused_update(None) is None


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_takes_a_learning_rate_set_in_place_bit_for_bit(nesterov):
    # The kernel keeps `-lr` (its host value without Nesterov) while the
    # learning-rate tensor is unwritten: a rate set between steps (written
    # into the same tensor) must be seen. Checked on the same float32 values
    # against Keras on torch without Nesterov, bit for bit: its
    # `_foreach_mul_(m, momentum)`, `_foreach_add_(m, g, alpha=-lr)`; with
    # Nesterov against `update_step`'s formula (torch's Nesterov step rounds
    # its sum its own way).
    rng = np.random.default_rng(11)
    start = rng.normal(size=(64, 33)).astype(np.float32)
    w = torch.tensor(start)
    opt = SGD(0.1, momentum=0.9, nesterov=nesterov)
    opt.build([w])
    lr_tensor = opt.learning_rate
    want, m = torch.tensor(start), torch.zeros(64, 33)
    for step in range(4):
        rate = np.float32(0.1 * 0.7**step)
        opt.learning_rate = float(rate)
        assert opt.learning_rate is lr_tensor  # the same tensor, written in place
        g = torch.tensor(rng.normal(size=(64, 33)).astype(np.float32))
        opt.apply([g], [w])
        if nesterov:
            lr = torch.tensor(rate)
            m = m * 0.9 - g * lr
            want = want + (m * 0.9 - g * lr)
            torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-7)
        else:
            torch._foreach_mul_([m], 0.9)
            torch._foreach_add_([m], [g], alpha=-float(rate))
            torch._foreach_add_([want], [m])
            assert torch.equal(w, want), step


@pytest.mark.parametrize(
    "rate, as_dampening",
    [
        (0.05, True),
        (2.0**-29 * 1.2345678, True),  # the smallest exponent where `1 + lr` is exact
        (2.0**-30 * 1.2345678, False),  # its last bits would be lost: `-lr * g` tensors
        (3.0, True),
    ],
)
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_takes_the_rate_as_dampening_only_where_that_is_exact(
    monkeypatch, rate, as_dampening, nesterov
):
    """On each side of the exactness limit, the one-pass kernel or the product path, each exact."""
    rate = float(np.float32(rate))
    seen = []
    fused_sgd = torch._fused_sgd_

    def spy(*args, **kwargs):
        seen.append(kwargs["dampening"])
        return fused_sgd(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_sgd_", spy)
    rng = np.random.default_rng(3)
    start = rng.normal(size=(48, 40)).astype(np.float32)
    w, opt = torch.tensor(start), SGD(rate, momentum=0.5, nesterov=nesterov)
    want, m = torch.tensor(start), torch.zeros(48, 40)
    for _ in range(3):
        g = torch.tensor(
            (rng.normal(size=(48, 40)) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
        )
        opt.apply([g], [w])
        if as_dampening and not nesterov:  # Keras on torch
            torch._foreach_mul_([m], 0.5)
            torch._foreach_add_([m], [g], alpha=-rate)
            want += m
        else:  # `update_step`'s formula, and torch's Nesterov sum
            m = m * 0.5 - g * torch.tensor(rate)
            want = want + (m * 0.5 - g * torch.tensor(rate) if nesterov else m)
    assert seen == [1.0 + rate if as_dampening and not nesterov else 0.0] * 3
    if nesterov:
        torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(w, want)


# --- torch.compile: the traced step calls lossscale::fused_adam_ -------------------


def _adam_run(name, compiled, graphs=None):
    generator = torch.Generator().manual_seed(1)
    shapes = [(6, 4), (4,), (3,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    opt = ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=64.0, dynamic_growth_steps=2)
    opt.scale_loss(1.0)
    opt.build(params)

    def step(grads):
        opt.apply(grads, params)

    if compiled:

        def capture(graph_module, example_inputs):
            graphs.append(graph_module)
            return torch._dynamo.backends.debugging.aot_eager(graph_module, example_inputs)

        step = torch.compile(step, fullgraph=True, backend=capture)
    for kind in ["f", "f", "inf", "f", "nan", "f", "f", "f"]:
        grads = [torch.randn(p.shape, generator=generator) * 64 for p in params]
        if kind != "f":
            grads[1][0] = float(kind)
        if compiled:  # the same values, transposed in memory: copied to the weight's layout
            grads[0] = grads[0].t().contiguous().t()
        step(grads)
    return [p.detach().clone() for p in params + [v.value for v in opt.variables]]


@pytest.mark.parametrize("name", ["adam", "adam_amsgrad", "adamw"])
def test_a_compiled_adam_step_equals_the_eager_one_bit_for_bit(name):
    """Traced on the CPU, Adam is one opaque call that runs the eager step (`fused._opaque`).

    The compiled run's first gradient is laid out otherwise than its weight
    (transposed); the eager run's is not (`backends/torch/layout.py`).
    """
    graphs = []
    torch.compiler.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _adam_run(name, True, graphs)
    torch.compiler.reset()
    eager = _adam_run(name, False)
    assert len(compiled) == len(eager)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b), (a, b)
    (graph,) = graphs
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count("lossscale.fused_adam_.default") == 1, targets
