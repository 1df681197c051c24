"""optimizers/loss_scale_step.py on torch: operations per step, torch.compile, CUDA graphs.

The semantics of the step (unscale, check, skip, scale update) are tested on
every backend in tests/optimizers/test_loss_scale_optimizer.py; here the shape of the
torch step: how many operations it dispatches (each is a kernel launch on a
GPU) and that it compiles into one graph that never recompiles.
"""

import warnings

import numpy as np
import pytest
import torch

import lossscale as ls
from tests.torch_cases import OPTIMIZERS, count_ops

# The fused paths: a step's every operation, 16 parameters in one group.
# torch.amp.GradScaler + torch.optim.Adam(fused=True) dispatches 13.
# The fused kernels take the AMP check's own `found_inf` (the explicit
# `found_inf` of `_step`: no select of a new one from `keep`). On the CPU
# Adam's step size is computed on the host from the step count (one read)
# and AdamW's decay is folded into torch's fused AdamW kernel.
FUSED_OPS = {
    "sgd": 9,
    "sgd_momentum": 9,
    "sgd_nesterov": 10,
    "adam": 10,
    "adam_amsgrad": 10,
    "adamw": 10,
}
# Where nothing is read on the host (a GPU, forced below by making the CPU
# not host-readable): Adam's step size is six kernels (`1 - beta**t` written
# into a kept pair whose elements are views made once: no `unbind`), and
# AdamW's decay its own pass (the factor kept while the learning rate does
# not change, a select of it under `keep`, one multiplication per group).
DEVICE_OPS = {"adam": 15, "adamw": 17}


def device_path(monkeypatch):
    """Makes the CPU not host-readable: the step then takes the path it takes on a GPU."""
    from lossscale.backends.torch import multi

    monkeypatch.setattr(multi, "HOST_READABLE", frozenset())


def ops_per_step(make, count, shape=(64, 32)):
    """The aten operations of one warm `apply` on `count` parameters."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for _ in range(count)]
    grads = [torch.randn(shape, generator=generator) * 1024 for _ in range(count)]
    opt = ls.LossScaleOptimizer(make(), initial_scale=1024.0)
    opt.scale_loss(1.0)
    for _ in range(3):  # builds, caches the plans and packing buffers
        opt.apply([g.clone() for g in grads], params)
    given = [g.clone() for g in grads]
    with count_ops() as ops:
        opt.apply(given, params)
    return ops


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_operations_per_step_do_not_grow_with_the_parameters(name):
    ops = ops_per_step(OPTIMIZERS[name], 16)
    assert len(ops_per_step(OPTIMIZERS[name], 32)) == len(ops), name
    if name in FUSED_OPS:
        assert len(ops) == FUSED_OPS[name] <= 18, ops
        # No per-tensor work at all (selects, reductions, aliases): each
        # kernel covers the whole group.
        per_tensor = {"aten.where.self_out", "aten.aminmax.default", "aten.detach.default"}
        assert not per_tensor & set(ops), ops


def test_the_adam_step_names_its_operations():
    ops = ops_per_step(OPTIMIZERS["adam"], 16)
    assert ops == [
        # A CPU scale is read on the host (nothing to wait for): a power of
        # two >= 1, so one AMP pass divides and checks the unscaled values
        # (tests/backends/torch/test_multi.py). A CUDA scale is not read: there
        # `_foreach_div_` unscales, and the AMP kernel checks at scale 1.
        "aten._local_scalar_dense.default",
        "aten.zeros.default",  # the found_inf flag
        "aten._amp_foreach_non_finite_check_and_unscale_.default",  # unscale, and check
        "aten.eq.Scalar",  # the flag as a boolean, for the step counter
        # The step count, read on the host: the step size is computed there
        # (the learning rate read once, kept while its tensor is unwritten).
        "aten._local_scalar_dense.default",
        "aten._fused_adam_.default",  # skips itself where the check's found_inf is 1
        "aten.add_.Tensor",  # iterations += finite
        "aten._amp_update_scale_.default",  # the scale and the counter, in place
        "aten.mul.Tensor",
        "aten.clamp_min_.Tensor",  # the backoff floor
    ]


def test_the_adamw_step_folds_the_decay_into_the_kernel():
    adam = ops_per_step(OPTIMIZERS["adam"], 16)
    adamw = ops_per_step(OPTIMIZERS["adamw"], 16)
    assert adamw == [op.replace("_fused_adam_", "_fused_adamw_") for op in adam]
    assert len(adamw) == FUSED_OPS["adamw"] <= 13


def test_the_device_adam_step_names_its_operations(monkeypatch):
    device_path(monkeypatch)
    ops = ops_per_step(OPTIMIZERS["adam"], 16)
    assert ops == [
        "aten._foreach_div_.Tensor",  # the scale is not read: divided, then checked at 1
        "aten.zeros.default",  # the found_inf flag
        "aten._amp_foreach_non_finite_check_and_unscale_.default",
        "aten.eq.Scalar",
        "aten.add.out",  # t = iterations + 1, cast as it is stored
        "aten.pow.Tensor_Tensor",  # (beta_1, beta_2) ** t
        "aten.sub.out",  # 1 - that, into the kept pair (views of it made once)
        "aten.sqrt.default",
        "aten.mul.Tensor",  # alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)
        "aten.div.Tensor",
        "aten._fused_adam_.tensor_lr",
        "aten.add_.Tensor",
        "aten._amp_update_scale_.default",
        "aten.mul.Tensor",
        "aten.clamp_min_.Tensor",
    ]
    assert len(ops) == DEVICE_OPS["adam"]


def test_the_device_adamw_step_adds_the_decay_select_and_multiplication(monkeypatch):
    device_path(monkeypatch)
    adam = ops_per_step(OPTIMIZERS["adam"], 16)
    adamw = ops_per_step(OPTIMIZERS["adamw"], 16)
    at = adam.index("aten.add.out")  # the decay runs before the Adam update
    assert adamw == adam[:at] + ["aten.where.self", "aten._foreach_mul_.Tensor"] + adam[at:]
    assert len(adamw) == DEVICE_OPS["adamw"]


def test_the_sgd_momentum_step_names_its_operations():
    ops = ops_per_step(OPTIMIZERS["sgd_momentum"], 16)
    assert ops == [
        "aten._local_scalar_dense.default",  # the CPU scale, read on the host
        "aten.zeros.default",  # the found_inf flag
        "aten._amp_foreach_non_finite_check_and_unscale_.default",
        "aten.eq.Scalar",  # the flag as a boolean, for the step counter
        # `-lr` as `1 - dampening` (the CPU rate read on the host once, kept
        # while the learning rate is unchanged): no `-lr * g` tensors.
        "aten._fused_sgd_.default",  # skips itself where the check's found_inf is 1
        "aten.add_.Tensor",  # iterations += finite
        "aten._amp_update_scale_.default",
        "aten.mul.Tensor",
        "aten.clamp_min_.Tensor",  # the backoff floor
    ]


# --- torch.compile ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_compiles_into_one_graph_that_never_recompiles(name):
    torch.compiler.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        runs = _compiled_and_eager(name)
    torch.compiler.reset()
    (compiled_trail, compiled_params), (eager_trail, eager_params) = runs
    assert compiled_trail == eager_trail
    # Compiled on the CPU, Adam runs the eager step as one opaque operation
    # (`lossscale::fused_adam_`, bit for bit: tests/backends/torch/test_fused.py);
    # SGD takes its foreach rule (torch cannot trace its fused kernels), which
    # rounds a little differently from the fused one.
    for a, b in zip(compiled_params, eager_params):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


# docs/torch.md's lean compile: Dynamo's tensor guards only, no Inductor size asserts.
LEAN = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe, "size_asserts": False}


@pytest.mark.parametrize("options", [{}, LEAN], ids=["default", "lean"])
def test_an_inductor_compiled_adam_step_is_the_eager_step_bit_for_bit(options):
    """Inductor itself, with and without the lean options: one graph, and the eager run exactly.

    Compiled on the CPU, Adam's update is the eager step as one opaque
    operation (`lossscale::fused_adam_`); the unscale and finite check are
    Inductor's loops, over a gradient past torch's packing threshold and
    small ones, with an inf and a NaN at either end of a gradient.
    """
    shapes = [(300, 250), (7,), (3, 5)]  # 75,000 elements: past PACK_BELOW (2**16)
    bad = {2: (0, 0, float("inf")), 4: (0, -1, float("nan")), 5: (1, -1, float("-inf"))}
    runs = []
    for compiled in (True, False):
        generator = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
        opt = ls.LossScaleOptimizer(
            OPTIMIZERS["adam"](), initial_scale=64.0, dynamic_growth_steps=2
        )
        opt.scale_loss(1.0)
        opt.build(params)

        def step(grads, opt=opt, params=params):
            opt.apply(grads, params)

        if compiled:
            torch.compiler.reset()
            torch._dynamo.utils.counters.clear()
            step = torch.compile(step, fullgraph=True, options=options)
        trail = []
        for k in range(7):
            grads = [torch.randn(s, generator=generator) * 64 for s in shapes]
            if k in bad:
                which, at, value = bad[k]
                grads[which].view(-1)[at] = value
            with torch._dynamo.config.patch(error_on_recompile=True):
                step(grads)
            trail.append((float(opt.dynamic_scale), int(opt.iterations)))
        if compiled:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
            torch.compiler.reset()
        runs.append((trail, [p.detach().clone() for p in params]))
    (compiled_trail, compiled_params), (eager_trail, eager_params) = runs
    assert compiled_trail == eager_trail
    assert [it for _, it in eager_trail] == [1, 2, 2, 3, 3, 3, 4]  # three skipped steps
    assert all(torch.equal(a, b) for a, b in zip(compiled_params, eager_params))


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_a_compiled_step_divides_the_gradients_inside_the_update(name):
    """Traced, Adam takes the loss scale into its kernel: no divided copy of a gradient.

    The eager step's one AMP pass (divide and check) became, traced, a loop
    writing the divided gradients into fresh buffers every step (on
    `large`, 64 MiB page-faulted in again each step: the compiled step 3.4x
    the eager one). Now a reduction reads the scaled gradients and torch's
    fused kernel divides them as it updates: after an applied step the
    caller's gradients hold the unscaled values, after a skipped one the
    scaled ones, untouched.
    """
    shapes = [(300, 250), (7,), (3, 5)]  # past PACK_BELOW, and small ones
    generator = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    opt = ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=64.0, dynamic_growth_steps=2)
    opt.scale_loss(1.0)
    opt.build(params)
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch.compiler.reset()
    step = torch.compile(lambda grads: opt.apply(grads, params), fullgraph=True, backend=capture)
    for k, bad in enumerate([None, (0, -1), None, (2, 0), None]):
        grads = [torch.randn(s, generator=generator) * 64 for s in shapes]
        if bad is not None:
            grads[bad[0]].view(-1)[bad[1]] = float("nan")
        scaled, scale = [g.clone() for g in grads], float(opt.dynamic_scale)
        with torch._dynamo.config.patch(error_on_recompile=True):
            step(grads)
        expected = scaled if bad is not None else [g / scale for g in scaled]
        bits = [(g.view(torch.int32), e.view(torch.int32)) for g, e in zip(grads, expected)]
        assert all(torch.equal(g, e) for g, e in bits), k  # NaN included
    torch.compiler.reset()
    (graph,) = graphs
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    (adam,) = [n for n in calls if str(n.target) == "lossscale.fused_adam_.default"]
    assert adam.args[-1] is not None  # the scale, divided out in torch's kernel
    # Nothing else makes a tensor of a gradient's size: no divided copy.
    sizes = {int(np.prod(s)) for s in shapes if int(np.prod(s)) > 64}
    made = [
        str(n.target)
        for n in calls
        if n is not adam
        and isinstance(n.meta.get("example_value"), torch.Tensor)
        and n.meta["example_value"].numel() in sizes
    ]
    assert made == [], made


def test_the_unscaled_loss_warning_is_given_once_without_breaking_the_graph():
    # `scale_loss` never called: the warning is given while tracing (a
    # constant to the compiler), not replayed by the compiled step.
    torch.compiler.reset()
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), initial_scale=8.0)
    opt.build(params)
    step = torch.compile(lambda grads: opt.apply(grads, params), fullgraph=True, backend="eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            step([torch.randn(4, 3) for _ in range(3)])
    torch.compiler.reset()
    assert [type(w.message) for w in seen] == [ls.mixed_precision.UnscaledLossWarning]
    assert int(opt.inner_optimizer.iterations) == 3


def test_the_compiled_check_is_left_to_the_compiler():
    """No AMP check kernel in the traced step: it would run on functional copies.

    Compiled, the finite check is plain reductions the compiler fuses into
    the loops that unscale the gradients.
    """
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch.compiler.reset()
    generator = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in [(6, 4), (4,)]]
    opt = ls.LossScaleOptimizer(OPTIMIZERS["adam"](), initial_scale=64.0)
    opt.scale_loss(1.0)
    opt.build(params)
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    torch.compile(lambda: opt.apply(grads, params), fullgraph=True, backend=capture)()
    torch.compiler.reset()
    (graph,) = graphs
    called = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert not any("non_finite_check" in name for name in called), called
    assert any("isfinite" in name for name in called), called


def _compiled_and_eager(name):
    runs = []
    for compiled in (True, False):
        generator = torch.Generator().manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in [(6, 4), (4,)]]
        opt = ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=64.0, dynamic_growth_steps=2)
        opt.scale_loss(1.0)
        opt.build(params)

        def step(grads, opt=opt, params=params):
            opt.apply(grads, params)

        if compiled:
            # fullgraph: any graph break is an error; aot_eager traces like
            # the default backend without generating code.
            step = torch.compile(step, fullgraph=True, backend="aot_eager")
        trail = []
        for kind in ["f", "f", "inf", "f", "nan", "f", "f"]:
            grads = [torch.randn(p.shape, generator=generator) * 64 for p in params]
            if kind != "f":
                grads[1][0] = float(kind)
            before = [p.detach().clone() for p in params]
            step(grads)
            if kind != "f":  # skipped: every parameter bit for bit as it was
                assert all(torch.equal(b, p) for b, p in zip(before, params))
            trail.append((float(opt.dynamic_scale), int(opt.iterations)))
        runs.append((trail, [p.detach().clone() for p in params]))
    return runs


# --- CUDA graphs (collected where CUDA exists) --------------------------------------


def cuda_graph_replays_a_step(make):
    """A whole step captured once in a CUDA graph and replayed on new gradients.

    A GPU check, not collected on machines without CUDA (CI has none, and a
    skipped test would read as a missing feature).
    """
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = [(64, 32), (32,), (32, 8)]
    init = [torch.randn(s, device=device, generator=generator) for s in shapes]
    steps = [
        [torch.randn(s, device=device, generator=generator) * 8 for s in shapes] for _ in range(6)
    ]
    steps[3][1][0] = float("inf")

    def make_run():
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = ls.LossScaleOptimizer(make(), initial_scale=8.0, dynamic_growth_steps=2)
        opt.scale_loss(1.0)
        return params, opt

    params, opt = make_run()
    static = [torch.zeros(s, device=device) for s in shapes]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for g, x in zip(static, steps[0]):
            g.copy_(x)
        opt.apply(static, params)  # warm: builds, caches plans and buffers
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.apply(static, params)
    eager_params, eager = make_run()
    eager.apply([x.clone() for x in steps[0]], eager_params)
    for grads in steps[1:]:
        for g, x in zip(static, grads):
            g.copy_(x)
        graph.replay()
        eager.apply([x.clone() for x in grads], eager_params)
    torch.cuda.synchronize()
    for a, b in zip(params, eager_params):
        assert torch.equal(a, b)
    assert float(opt.dynamic_scale) == float(eager.dynamic_scale)


if torch.cuda.is_available():
    test_cuda_graph_replays_a_step = pytest.mark.parametrize(
        "make",
        [OPTIMIZERS["adam"], OPTIMIZERS["adamw"], OPTIMIZERS["lion"]],
        ids=["adam", "adamw", "lion"],
    )(cuda_graph_replays_a_step)
