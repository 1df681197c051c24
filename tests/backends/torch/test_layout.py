"""torch layout: gradients laid out otherwise than their parameters are applied as if they were.

`torch.autograd.grad` returns channels-last gradients of contiguous weights
(under a channels-last input) and expanded ones (stride 0, for a weight used
only through a sum). Every optimizer, bare and wrapped, must apply them as
it applies the same values laid out as the parameters, bit for bit, skip
the steps where one of them holds an inf or NaN, and never read past them.
(A compiled step's gradient laid out otherwise: tests/backends/torch/test_fused.py.)
"""

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends.torch import layout
from tests.torch_cases import OPTIMIZERS, apply

# Gradients of each layout on both sides of the packing threshold
# (`multi.PACK_BELOW`, 65,536 elements): (parameter shape, how the gradient
# is laid out).
CASES = [
    ((64, 64, 3, 3), "channels_last"),  # 36,864 elements
    ((128, 64, 3, 3), "channels_last"),  # 73,728
    ((300, 200), "transposed"),  # 60,000
    ((400, 300), "transposed"),  # 120,000
    ((64, 300), "expanded"),  # 19,200 elements on 300 numbers
    ((256, 300), "expanded"),  # 76,800
    ((513,), "contiguous"),
]


def test_dense():
    t = torch.zeros(4, 3, 5, 6)
    assert layout.dense(t)
    assert layout.dense(t.contiguous(memory_format=torch.channels_last))
    assert layout.dense(t.permute(3, 1, 0, 2))
    assert layout.dense(torch.zeros(5, 1).t())  # size-1 dimensions take any stride
    assert layout.dense(torch.zeros(0, 3))
    assert not layout.dense(torch.zeros(3).expand(4, 3))
    assert not layout.dense(torch.zeros(4, 3)[:, :2])
    assert not layout.dense(torch.zeros(8)[::2])


def test_in_layout_of_returns_the_same_list_when_every_layout_matches():
    params = [torch.zeros(3, 4), torch.zeros(5)]
    grads = [torch.ones(3, 4), torch.ones(5)]
    assert layout.in_layout_of(grads, params, True) is grads


@pytest.mark.parametrize("how", ["channels_last", "transposed", "expanded"])
def test_in_layout_of_copies_into_the_parameters_strides(how):
    rng = np.random.default_rng(0)
    shape = (6, 5, 3, 3) if how == "channels_last" else (6, 5)
    param = torch.zeros(shape)
    grad = _laid_out(rng.normal(size=shape).astype(np.float32), how)
    (out,) = layout.in_layout_of([grad], [param], True)
    assert out.stride() == param.stride()
    assert torch.equal(out, grad)


def _values(rng, shape, how):
    if how == "expanded":  # one row of numbers, repeated
        return np.broadcast_to(rng.normal(size=shape[1:]), shape).astype(np.float32)
    return rng.normal(size=shape).astype(np.float32)


def _laid_out(values, how):
    """`values` as a torch tensor laid out `how` (equal values, other strides)."""
    if how == "channels_last":
        return torch.tensor(values).contiguous(memory_format=torch.channels_last)
    if how == "transposed":
        return torch.tensor(values.T.copy()).t()
    if how == "expanded":
        return torch.tensor(values[0].copy()).expand(values.shape)
    return torch.tensor(values)


def _run(name, wrap, laid_out):
    """Five steps of `name` on CASES' parameters; returns parameters and optimizer state.

    Steps 2 and 4 put an inf (then a NaN) in the gradients laid out
    otherwise: at the first element, the last, and a random one.
    """
    rng = np.random.default_rng(1)
    params = [torch.tensor(rng.normal(size=shape), dtype=torch.float32) for shape, _ in CASES]
    opt = (
        ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=8.0) if wrap else OPTIMIZERS[name]()
    )
    scale = 8.0 if wrap else 1.0
    history = []
    for step in range(5):
        values = [scale * _values(rng, shape, how) for shape, how in CASES]
        if step in (2, 4):
            bad = np.inf if step == 2 else np.nan
            for i, (shape, how) in enumerate(CASES[:-1]):
                flat = np.ascontiguousarray(values[i]).reshape(-1)
                if how == "expanded":  # each number stands for a column
                    flat = np.ascontiguousarray(values[i][0]).reshape(-1)
                position = (0, flat.size - 1, int(rng.integers(flat.size)))[i % 3]
                flat[position] = bad
                values[i] = (
                    np.broadcast_to(flat, shape) if how == "expanded" else flat.reshape(shape)
                )
        grads = [
            _laid_out(v, how) if laid_out else torch.tensor(np.ascontiguousarray(v))
            for v, (_, how) in zip(values, CASES)
        ]
        given = [g.clone() for g in grads]
        apply(opt, grads, params)
        if not wrap or step not in (2, 4):
            history.append([p.clone() for p in params])
        if laid_out and (not wrap or step in (2, 4)):
            # Not divided in the caller's tensors where they cannot be
            # written (an expanded one), nor by a bare optimizer.
            for g, was in zip(grads, given):
                if not layout.dense(g) or not wrap:
                    assert torch.equal(_bits(g), _bits(was))
    state = [torch.as_tensor(v.value).clone() for v in opt.variables]
    return history, [p.clone() for p in params], state


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.int32)


@pytest.mark.parametrize("wrap", [True, False], ids=["wrapped", "bare"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_gradients_laid_out_otherwise_are_applied_bit_for_bit(name, wrap):
    _, params, state = _run(name, wrap, laid_out=True)
    _, want_params, want_state = _run(name, wrap, laid_out=False)
    for got, want in zip(params + state, want_params + want_state):
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("where", ["first", "last", "random"])
@pytest.mark.parametrize("case", range(len(CASES) - 1))
def test_a_wrapped_step_skips_an_inf_in_a_gradient_laid_out_otherwise(case, where):
    rng = np.random.default_rng(3)
    params = [torch.tensor(rng.normal(size=shape), dtype=torch.float32) for shape, _ in CASES]
    opt = ls.LossScaleOptimizer(OPTIMIZERS["adamw"](), initial_scale=8.0)
    for _ in range(2):
        values = [8.0 * _values(rng, shape, how) for shape, how in CASES]
        apply(opt, [_laid_out(v, how) for v, (_, how) in zip(values, CASES)], params)
    before = [p.clone() for p in params] + [v.value.clone() for v in opt.variables]
    values = [8.0 * _values(rng, shape, how) for shape, how in CASES]
    shape, how = CASES[case]
    row = np.array(values[case][0] if how == "expanded" else values[case])
    flat = row.reshape(-1)
    flat[{"first": 0, "last": flat.size - 1, "random": int(rng.integers(flat.size))}[where]] = (
        np.inf
    )
    values[case] = np.broadcast_to(row, shape) if how == "expanded" else row
    apply(opt, [_laid_out(v, how) for v, (_, how) in zip(values, CASES)], params)
    after = params + [v.value for v in opt.variables]
    names = [v.path for v in opt.variables]
    for got, was, name in zip(after, before, [None] * len(params) + names):
        if name is not None and ("scale" in name or "counter" in name):
            continue
        assert torch.equal(_bits(got), _bits(was))
    assert float(opt.dynamic_scale.value) == 4.0


@pytest.mark.parametrize("name", ["sgd", "sgd_momentum", "adam", "adamw"])
def test_a_parameter_that_is_a_strided_view_takes_the_kernels_that_follow_strides(name):
    """A fused kernel would write `numel` elements from the view's start, over the gaps."""
    rng = np.random.default_rng(4)
    base = torch.tensor(rng.normal(size=(300, 400)), dtype=torch.float32)
    gaps = base[:, 1::2].clone()
    strided = base[:, ::2]  # 60,000 elements, every other column
    dense = strided.clone()
    opts = [ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=8.0) for _ in range(2)]
    for _ in range(3):
        grad = 8.0 * rng.normal(size=(300, 200)).astype(np.float32)
        apply(opts[0], [torch.tensor(grad)], [strided])
        apply(opts[1], [torch.tensor(grad)], [dense])
    assert torch.equal(_bits(base[:, 1::2]), _bits(gaps))
    # The `foreach` kernels round as `update_step`; the fused ones within 1e-7 a step.
    np.testing.assert_allclose(strided.numpy(), dense.numpy(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(strided, base[:, 1::2])


def test_disjoint():
    base = torch.zeros(10)
    a, b = torch.zeros(3), torch.zeros(3)
    assert layout.disjoint([a, b])
    assert layout.disjoint([base[:5], base[5:]])
    assert not layout.disjoint([base[:5], base[4:]])
    assert not layout.disjoint([base, base[2:4]])
    assert not layout.disjoint([base[::2], base[1::2]])  # interleaved: counted as sharing
    assert layout.disjoint([base[:0], base[:5]])  # an empty view holds nothing


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_channels_last_parameters_train_as_contiguous_ones_bit_for_bit(name):
    """Their slots are made channels-last too, as torch's optimizers make them.

    Lamb's norms are sums in memory order: there the last bit may differ.
    """
    shapes = [(64, 64, 3, 3), (128, 64, 3, 3)]  # both sides of the packing threshold
    runs = []
    for channels_last in (False, True):
        rng = np.random.default_rng(5)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        params = [torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in shapes]
        params = [p.contiguous(memory_format=fmt) for p in params]
        opt = ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=8.0)
        for step in range(4):
            grads = [8.0 * rng.normal(size=s).astype(np.float32) for s in shapes]
            if step == 2:
                grads[1].reshape(-1)[int(rng.integers(grads[1].size))] = np.nan
            apply(opt, [torch.tensor(g).contiguous(memory_format=fmt) for g in grads], params)
        if channels_last:
            slots = [v.value for v in opt.inner_optimizer.variables if v.value.dim() == 4]
            assert all(s.is_contiguous(memory_format=fmt) for s in slots)
        runs.append(params + [v.value for v in opt.variables])
    for got, want in zip(*runs):
        if name == "lamb":  # its norms sum in memory order: the last bit may differ
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "adamw"])
def test_half_gradients_laid_out_otherwise_are_applied_bit_for_bit(name):
    """float16 gradients of float32 weights: cast, then copied into the weights' layout."""
    shapes = [(64, 64, 3, 3), (128, 64, 3, 3)]  # both sides of the packing threshold
    runs = []
    for channels_last in (False, True):
        rng = np.random.default_rng(6)
        params = [torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in shapes]
        opt = ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=8.0)
        for step in range(3):
            grads = [torch.tensor(8.0 * rng.normal(size=s), dtype=torch.float16) for s in shapes]
            if step == 1:
                grads[0].view(-1)[-1] = float("inf")
            if channels_last:
                grads = [g.contiguous(memory_format=torch.channels_last) for g in grads]
            apply(opt, grads, params)
        runs.append(params + [v.value for v in opt.variables])
    for got, want in zip(*runs):
        assert torch.equal(_bits(got), _bits(want))
