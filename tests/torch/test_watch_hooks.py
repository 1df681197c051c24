"""`lossscale.torch.watch`'s hooks on their own: which module each overflow started in.

The hooks are driven through their observer protocol (`on_step`,
`modules_at`) as a target calls it; tests/torch/test_grad_scaler.py
runs them under `GradScaler` and `LossScaleOptimizer`.
"""

import pytest
import torch
import torch.nn.functional as F

from lossscale.torch.watch_hooks import Watch
from tests import grad_scaler_cases as cases
from tests.torch_cases import no_host_reads

SCALE = 2.0**16


class MLP(torch.nn.Module):
    """Three linears; one `ReLU(inplace=True)` module called twice."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(16, 64)
        self.act = torch.nn.ReLU(inplace=True)
        self.mid = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.out(self.act(self.mid(self.act(self.inp(x)))))


def mlp_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def mlp_loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(x), y)


def overflow_in_backward(before, layer):
    """Makes `layer` overflow float16 in backward only: small inputs, huge weights.

    `before` (the linear feeding it) is shrunk 1000x and `layer`'s weight
    grown 1000x: the forward values stay as they were, while the gradient of
    `layer`'s input, `weight.T @ grad`, grows 1000x past float16's range.
    """
    with torch.no_grad():
        before.weight.mul_(1e-3)
        before.bias.mul_(1e-3)
        layer.weight.mul_(1e3)


def nan_output(module):
    """A forward hook that puts a NaN into one element of `module`'s output.

    Prepended, so that it runs before `watch`'s hook: the NaN is part of the
    module's output, as if its forward had made it.
    """

    def hook(mod, args, output):
        output = output.clone()
        output.view(-1)[output.numel() // 3] = float("nan")
        return output

    return module.register_forward_hook(hook, prepend=True)


def backward_step(model, loss_fn, data, scale=SCALE):
    model.zero_grad(set_to_none=True)
    (loss_fn(model, *data) * scale).backward()


def grads_finite(model):
    return all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)


def test_a_backward_overflow_is_traced_to_its_layer_through_inplace_and_reuse():
    model = MLP()
    overflow_in_backward(model.inp, model.mid)
    watch = Watch(model)
    backward_step(model, mlp_loss, mlp_batch())
    assert not grads_finite(model)
    watch.on_step(torch.tensor(False), torch.tensor(5, dtype=torch.int32))
    assert watch.modules_at([5]) == {5: "mid"}


def test_a_backward_overflow_in_a_transformer_layer_is_traced_to_it():
    model = cases.TinyTransformer()
    overflow_in_backward(model.encoder.linear1, model.encoder.linear2)
    watch = Watch(model)
    backward_step(model, cases.loss_of, cases.batch())
    assert not grads_finite(model)
    watch.on_step(torch.tensor(False), 0)
    assert watch.modules_at([0]) == {0: "encoder.linear2"}


def test_an_overflow_of_the_first_layer_is_seen_through_its_weight_gradient():
    # Its input does not require grad: only its weight's gradient (the sum
    # over the batch of grad * input, inputs 1000x larger) overflows.
    model = MLP()
    with torch.no_grad():
        model.inp.weight.mul_(1e-3)
    watch = Watch(model)
    x, y = mlp_batch()
    backward_step(model, mlp_loss, (x * 1e3, y))
    bad = [n for n, p in model.named_parameters() if not bool(p.grad.isfinite().all())]
    assert bad == ["inp.weight"]
    watch.on_step(torch.tensor(False), 0)
    assert watch.modules_at([0]) == {0: "inp"}


@pytest.mark.parametrize("layer", ["inp", "mid"])
def test_a_nan_in_forward_is_traced_to_the_layer_that_made_it(layer):
    model = MLP()
    watch = Watch(model)
    injected = nan_output(getattr(model, layer))
    x, y = mlp_batch()
    loss = mlp_loss(model, x, y)
    assert not bool(loss.isfinite())
    (loss * SCALE).backward()
    watch.on_step(torch.tensor(False), 3)
    injected.remove()
    assert watch.modules_at([3]) == {3: layer}


class Block(torch.nn.Module):
    """A functional op between two linears: `b(a(x) * gain)`."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 4)
        self.gain = 1.0

    def forward(self, x):
        return self.b(self.a(x) * self.gain)


def test_a_nan_made_by_a_functional_op_is_traced_to_the_module_around_it():
    # `b` gets a non-finite input: its output is not where it started.
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), Block())
    model[1].gain = float("inf")
    watch = Watch(model)
    x, y = mlp_batch()
    (mlp_loss(model, x, y) * SCALE).backward()
    watch.on_step(torch.tensor(False), 0)
    assert watch.modules_at([0]) == {0: "1"}


def test_a_loss_made_nan_after_the_model_has_no_module():
    model = MLP()
    watch = Watch(model)
    x, y = mlp_batch()
    (mlp_loss(model, x, y) * float("inf") * SCALE).backward()
    watch.on_step(torch.tensor(False), 0)
    assert watch.modules_at([0]) == {0: None}


def test_a_nan_loss_in_a_transformer_has_no_module():
    # `MultiheadAttention` reads `out_proj.weight` without calling `out_proj`:
    # its NaN gradient must not make `out_proj` the origin.
    model = cases.TinyTransformer()
    watch = Watch(model)
    (cases.loss_of(model, *cases.batch()) * float("nan")).backward()
    watch.on_step(torch.tensor(False), 0)
    assert watch.modules_at([0]) == {0: None}


def test_no_grad_forwards_record_nothing():
    model = MLP()
    watch = Watch(model)
    injected = nan_output(model.mid)
    x, y = mlp_batch()
    with torch.no_grad():
        assert not bool(mlp_loss(model, x, y).isfinite())
    with torch.inference_mode():
        mlp_loss(model, x, y)
    injected.remove()
    backward_step(model, mlp_loss, (x, y))  # a finite step after them
    watch.on_step(torch.tensor(False), 0)
    assert watch.modules_at([0]) == {0: None}


def test_the_ring_keeps_the_last_overflows_and_finite_steps_stay_out():
    model = MLP()
    watch = Watch(model, history_length=3)
    injected = {"inp": None, "mid": None}
    order = ["inp", "mid", None, "inp", "mid", "mid"]
    for step, layer in enumerate(order):
        handle = nan_output(getattr(model, layer)) if layer else None
        backward_step(model, mlp_loss, mlp_batch())
        watch.on_step(torch.tensor(layer is None), step)
        if handle is not None:
            handle.remove()
    del injected
    # Steps 3, 4 and 5 overflowed last; 2 was finite; 0 and 1 left the ring.
    assert watch.modules_at([0, 1, 2, 3, 4, 5]) == {
        0: None,
        1: None,
        2: None,
        3: "inp",
        4: "mid",
        5: "mid",
    }


def test_the_flags_are_reset_after_every_step():
    model = MLP()
    watch = Watch(model)
    handle = nan_output(model.mid)
    backward_step(model, mlp_loss, mlp_batch())
    handle.remove()
    watch.on_step(torch.tensor(True), 0)  # a finite verdict: nothing kept, flags reset
    backward_step(model, mlp_loss, mlp_batch())
    watch.on_step(torch.tensor(False), 1)
    assert watch.modules_at([0, 1]) == {0: None, 1: None}


def test_full_backward_hooks_break_on_inplace_ops_where_watch_works():
    model = MLP()
    handle = model.inp.register_full_backward_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match="modified inplace"):
        backward_step(model, mlp_loss, mlp_batch())
    handle.remove()
    watch = Watch(model)
    backward_step(model, mlp_loss, mlp_batch())
    watch.on_step(torch.tensor(True), 0)


def test_the_hooks_change_no_gradient():
    data = cases.batch()
    plain = cases.TinyTransformer()
    backward_step(plain, cases.loss_of, data, scale=1024.0)
    watched = cases.TinyTransformer()
    Watch(watched)
    backward_step(watched, cases.loss_of, data, scale=1024.0)
    for p, q in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def _hook_count(model):
    count = 0
    for module in model.modules():
        count += len(module._forward_hooks) + len(module._forward_pre_hooks)
        count += len(module._backward_hooks) + len(module._backward_pre_hooks)
    for p in model.parameters():
        count += len(p._backward_hooks or {})
    return count


def test_remove_leaves_no_hook_and_stops_recording():
    model = MLP()
    before = _hook_count(model)
    watch = Watch(model)
    assert _hook_count(model) > before
    handle = nan_output(model.mid)
    backward_step(model, mlp_loss, mlp_batch())  # tensors of this graph hold hooks
    watch.remove()
    handle.remove()
    assert _hook_count(model) == before == 0
    watch.on_step(torch.tensor(False), 0)
    assert watch.modules_at([0]) == {0: "mid"}  # recorded before the removal
    model2 = MLP()
    overflow_in_backward(model2.inp, model2.mid)
    watch = Watch(model2)
    x, y = mlp_batch()
    loss = mlp_loss(model2, x, y) * SCALE
    watch.remove()  # between forward and backward: the graph's hooks record nothing
    loss.backward()
    assert not grads_finite(model2)
    watch.on_step(torch.tensor(False), 0)
    assert watch.modules_at([0]) == {0: None}
    watch.remove()  # twice: nothing left to remove


def test_a_step_with_hooks_reads_nothing_on_the_host():
    model = MLP()
    overflow_in_backward(model.inp, model.mid)
    watch = Watch(model)
    data = mlp_batch()
    with no_host_reads():
        backward_step(model, mlp_loss, data)
        finite = torch.stack([p.grad.isfinite().all() for p in model.parameters()]).all()
        watch.on_step(finite, torch.zeros((), dtype=torch.int32))
    assert watch.modules_at([0]) == {0: "mid"}


@pytest.mark.parametrize(
    "model, history_length, match",
    [
        ("not a module", 8, "`model` must be a torch.nn.Module"),
        (None, 0, "`history_length` must be an integer in 1..30"),
        (None, 31, "`history_length` must be an integer in 1..30"),
        (None, True, "`history_length` must be an integer in 1..30"),
    ],
)
def test_bad_arguments_are_named(model, history_length, match):
    with pytest.raises(ValueError, match=match):
        Watch(MLP() if model is None else model, history_length=history_length)


class _InfInBackward(torch.autograd.Function):
    """The identity forward; a backward that puts an inf into the gradient it passes on."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


class _Blow(torch.nn.Module):
    def forward(self, x):
        return _InfInBackward.apply(x)


def test_a_model_with_a_sparse_embedding_is_watched_through_its_stored_values():
    """`nn.Embedding(sparse=True)`'s gradient has no dense kernel: its values are checked."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 8, sparse=True), _Blow(), torch.nn.Linear(8, 1)
    )
    watch = Watch(model)
    tokens = torch.tensor([1, 2, 3, 2])
    (model(tokens).sum() * SCALE).backward()
    assert model[0].weight.grad.is_sparse
    watch.on_step(torch.tensor(False), 0)
    assert watch.modules_at([0]) == {0: "1"}  # where the inf started, not the embedding


def test_a_watched_loss_scale_optimizer_names_its_variables_from_the_module():
    import lossscale as ls

    model = MLP()
    params = list(model.parameters())
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.01), initial_scale=SCALE, telemetry=True)
    opt.build(params)  # unnamed torch tensors: param_0, param_1, ...
    handle = ls.torch.watch(model, opt)
    overflow_in_backward(model.inp, model.mid)
    backward_step(model, mlp_loss, mlp_batch())
    opt.apply([p.grad for p in params], params)
    (overflow,) = opt.summary()["overflows"]
    assert overflow["module"] == "mid" and overflow["variables"]
    assert set(overflow["variables"]) <= {name for name, _ in model.named_parameters()}
    assert opt.summary()["nonfinite_variables"] == overflow["variables"]
    handle.remove()  # the names go with the watch
    assert all(n.startswith("param_") for n in opt.summary()["overflows"][0]["variables"])
