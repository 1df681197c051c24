"""torch_multi: multi-tensor unscale, finite check, max |x| and global norm."""

import threading

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends.torch import multi as torch_multi


def storage(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def test_unscale_divides_in_float32_for_half_gradients():
    scale = torch.tensor(3.0)
    grads = [
        storage([1.0, 2.0], torch.float16),
        storage([3.0], torch.bfloat16),
        storage([4.0]),
        storage([5.0], torch.float64),
    ]
    out = torch_multi.unscale(grads, scale)
    assert [g.dtype for g in out] == [torch.float32, torch.float32, torch.float32, torch.float64]
    for g, o in zip(grads, out):
        wide = g.float() if g.dtype.itemsize < 4 else g
        assert torch.equal(o, wide / scale.to(wide.dtype))
    assert torch_multi.unscale([], scale) == []


def test_unscale_is_exact_division_for_any_scale():
    rng = np.random.default_rng(0)
    grads = [storage(rng.normal(size=50) * 1e3) for _ in range(3)]
    for value in (1000.0, 3.0, 2.0**15, float(np.finfo(np.float32).tiny)):
        scale = torch.tensor(value)
        for g, o in zip(grads, torch_multi.unscale(grads, scale)):
            assert torch.equal(o, g / scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, None])
def test_all_finite(dtype, bad):
    arrays = [
        storage(np.arange(6.0).reshape(2, 3), dtype),
        storage([1.0], torch.float32),
        torch.zeros(0, dtype=dtype),
        torch.arange(3),
    ]
    if bad is not None:
        arrays[0][1, 2] = bad
    assert bool(torch_multi.all_finite(arrays)) is (bad is None)


def test_all_finite_keeps_large_finite_values_finite():
    big = storage([1e300, -1e300], torch.float64)
    f32 = storage([3e38, -3e38] * 100)
    assert bool(torch_multi.all_finite([big, f32]))
    assert bool(torch_multi.all_finite([]))


def test_max_abs_and_global_norm():
    a = storage([3.0, -4.0], torch.float16)
    b = storage([[-12.0]], torch.float64)
    assert float(torch_multi.max_abs([a, b])) == 12.0
    assert torch_multi.max_abs([a, b]).dtype == torch.float32
    assert np.isnan(float(torch_multi.max_abs([a, storage([np.nan])])))
    assert float(torch_multi.global_norm([a, b])) == pytest.approx(13.0)


def test_groups_split_by_device_and_dtype():
    tensors = [torch.zeros(1), torch.zeros(1, dtype=torch.float16), torch.zeros(2)]
    assert [(d.type, t, list(i)) for d, t, i in torch_multi.groups(tensors)] == [
        ("cpu", torch.float32, [0, 2]),
        ("cpu", torch.float16, [1]),
    ]
    assert [list(i) for *_, i in torch_multi.groups(tensors[::2])] == [[0, 1]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, None])
def test_all_finite_of_unscaled_gradients_leaves_them_unchanged(dtype, bad):
    """`unscale`'s own results are checked in place on CPU; values must not move."""
    rng = np.random.default_rng(0)
    big = 1e30 if dtype.itemsize >= 4 else 1e4  # large, yet finite in the dtype
    grads = [storage(rng.normal(size=s) * big, dtype) for s in [(3, 4), (5,)]]
    if bad is not None:
        grads[1][2] = bad
    unscaled = torch_multi.unscale(grads, torch.tensor(3.0))
    before = [u.clone() for u in unscaled]
    user = storage([1.0, -2.0])  # not made by `unscale`: checked without writing
    assert bool(torch_multi.all_finite(unscaled + [user])) is (bad is None)
    for b, u in zip(before, unscaled):
        assert torch.equal(b.view(-1).view(torch.uint8), u.view(-1).view(torch.uint8))


def test_unscaled_gradients_in_an_autograd_graph_are_checked_without_writing():
    w = torch.ones(3, requires_grad=True)
    grads = [w * 2.0]  # e.g. from autograd.grad(..., create_graph=True)
    unscaled = torch_multi.unscale(grads, torch.tensor(2.0))
    assert bool(torch_multi.all_finite(unscaled))
    unscaled[0].sum().backward()  # still differentiable: nothing wrote into it
    assert w.grad.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "bad,where",
    [(None, None), (np.nan, "small"), (-np.inf, "small"), (np.nan, "large"), (np.inf, "large")],
)
def test_max_abs_packs_small_cpu_tensors_exactly(monkeypatch, bad, where):
    monkeypatch.setattr(torch_multi, "PACK_BELOW", 64)
    rng = np.random.default_rng(3)
    tensors = [
        torch.tensor(rng.standard_normal(s), dtype=torch.float32)
        for s in [(3, 4), (7,), (), (0, 5), (200,), (10, 10), (63,)]
    ]
    tensors[1][2] = -41.5  # the peak: negative, in a packed tensor
    if bad is not None:
        (tensors[5] if where == "small" else tensors[4]).view(-1)[7] = bad
    before = [t.clone() for t in tensors]
    peak = torch_multi.max_abs(tensors)
    assert peak.dtype == torch.float32 and peak.shape == ()
    if bad is None:
        assert float(peak) == 41.5
    elif np.isnan(bad):
        assert np.isnan(float(peak))
    else:
        assert float(peak) == np.inf
    for t, b in zip(tensors, before):  # read only
        assert torch.equal(t, b) or (torch.isnan(t).any() and torch.equal(t.isnan(), b.isnan()))


def test_max_abs_reuses_a_pack_per_shape_list_and_keeps_a_few(monkeypatch):
    monkeypatch.setattr(torch_multi, "PACK_BELOW", 64)
    monkeypatch.setattr(torch_multi, "_PACKS", threading.local())
    a, b = torch.ones(3), torch.full((2, 2), -2.0)
    assert float(torch_multi.max_abs([a, b])) == 2.0
    packs = torch_multi._PACKS.by_key
    (flat,) = [entry[0] for entry in packs.values()]
    assert float(torch_multi.max_abs([a * 5, b])) == 5.0  # new values, same buffer
    assert [entry[0] for entry in packs.values()] == [flat]
    for n in range(2, 2 + torch_multi._PACKS_KEPT):
        torch_multi.max_abs([torch.ones(n), torch.ones(1)])
    assert len(packs) == torch_multi._PACKS_KEPT and all(e[0] is not flat for e in packs.values())
    seen = []
    worker = threading.Thread(
        target=lambda: seen.append(
            (float(torch_multi.max_abs([a, b])), getattr(torch_multi._PACKS, "by_key", None))
        )
    )
    worker.start()
    worker.join()
    assert seen[0][0] == 2.0 and seen[0][1] is not packs  # each thread its own buffers


def test_max_abs_packs_at_most_pack_capacity_elements(monkeypatch):
    monkeypatch.setattr(torch_multi, "PACK_BELOW", 64)
    monkeypatch.setattr(torch_multi, "PACK_CAPACITY", 50)
    monkeypatch.setattr(torch_multi, "_PACKS", threading.local())
    tensors = [torch.full((20,), float(i)) for i in range(1, 5)]  # 80 elements, all small
    tensors[3][5] = -7.5
    assert float(torch_multi.max_abs(tensors)) == 7.5
    (flat,) = [entry[0] for entry in torch_multi._PACKS.by_key.values()]
    assert flat.numel() == 40  # the first two; the others were reduced one by one


def test_max_abs_packs_inside_and_outside_inference_mode(monkeypatch):
    monkeypatch.setattr(torch_multi, "PACK_BELOW", 64)
    monkeypatch.setattr(torch_multi, "_PACKS", threading.local())
    tensors = [torch.ones(3), torch.full((2,), -3.0)]
    with torch.inference_mode():
        assert float(torch_multi.max_abs(tensors)) == 3.0
    assert float(torch_multi.max_abs(tensors)) == 3.0
    with torch.inference_mode():
        assert float(torch_multi.max_abs(tensors)) == 3.0


# --- unscale_checked: one AMP pass where it is exact ------------------------------

ONE_PASS = [
    "aten._local_scalar_dense.default",  # the CPU scale, read on the host
    "aten.zeros.default",
    "aten._amp_foreach_non_finite_check_and_unscale_.default",
    "aten.eq.Scalar",  # the flag as a boolean
]


def _checked(grads, value, in_place=True):
    from tests.torch_cases import count_ops

    scale = torch.tensor(value)
    torch_multi.unscale_checked([torch.ones(1)], scale, True)  # caches the constants
    with count_ops() as ops:
        out, finite, skip = torch_multi.unscale_checked(grads, scale, in_place)
    return out, bool(finite), float(skip), ops


def _grads(rng, dtype=torch.float32):
    # Magnitudes from the dtype's subnormals to near its largest value:
    # quotients round, underflow to subnormals and to zero.
    info = torch.finfo(dtype)
    low, high = np.log10(info.smallest_normal) - 2, np.log10(info.max) - 0.5
    values = rng.choice([-1, 1], 300) * 10.0 ** rng.uniform(low, high, 300)
    wide = storage(values.astype(np.float32))
    return [wide[:100].to(dtype), wide[100:].to(dtype).reshape(20, 10)]


@pytest.mark.parametrize("exponent", [0, 1, 15, 24, 100, 126])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_checked_is_the_division_bit_for_bit_in_one_pass(exponent, dtype):
    rng = np.random.default_rng(exponent)
    grads = _grads(rng, dtype)
    value = 2.0**exponent
    expected = torch_multi.unscale([g.clone() for g in grads], torch.tensor(value))
    out, finite, skip, ops = _checked(grads, value)
    copies = ["aten._to_copy.default"] * 2 if dtype.itemsize < 4 else []  # into float32
    assert ops == ONE_PASS[:1] + copies + ONE_PASS[1:]
    assert all(torch.equal(o, e) for o, e in zip(out, expected))
    assert [o.dtype for o in out] == [torch.float32 if dtype.itemsize < 4 else dtype] * 2
    assert finite and skip == 0.0
    if dtype == torch.float32:  # in the caller's buffers, as `unscale` does in place
        assert all(o is g for o, g in zip(out, grads))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_checked_flags_a_non_finite_gradient_in_one_pass(bad):
    grads = _grads(np.random.default_rng(1))
    grads[1][3, 4] = bad
    _, finite, skip, ops = _checked(grads, 2.0**15)
    assert ops == ONE_PASS and not finite and skip == 1.0


@pytest.mark.parametrize(
    "value,in_place",
    [
        (3.0, True),  # 1/3 is not exact
        (0.5, True),  # dividing by it can overflow
        (2.0**127, True),  # 1/scale would be subnormal
        (2.0**15, False),  # float32 gradients that are not ours to write
    ],
)
def test_unscale_checked_divides_then_checks_otherwise(value, in_place):
    grads = _grads(np.random.default_rng(2))
    given = [g.clone() for g in grads]
    out, finite, skip, ops = _checked(given, value, in_place)
    assert "aten._foreach_div_.Tensor" in ops or "aten._foreach_div.Tensor" in ops, ops
    assert all(torch.equal(o, g / torch.tensor(value)) for o, g in zip(out, grads))
    overflows = bool(torch.stack([~torch.isfinite(g / value).all() for g in grads]).any())
    assert finite == (not overflows) and skip == float(overflows)
    if not in_place:
        assert all(torch.equal(a, b) for a, b in zip(given, grads))


def test_unscale_checked_catches_a_gradient_that_overflows_only_when_divided():
    grads = [storage([3e38, 1.0])]  # finite, but 3e38 / 0.5 is inf
    out, finite, skip, _ = _checked(grads, 0.5)
    assert not finite and skip == 1.0 and torch.isinf(out[0][0])


def test_unscale_checked_of_no_gradients_and_of_empty_ones():
    assert _checked([], 2.0)[:3] == ([], True, 0.0)
    out, finite, skip, _ = _checked([torch.zeros(0), storage([2.0])], 2.0)
    assert [o.tolist() for o in out] == [[], [1.0]] and finite and skip == 0.0


def test_unscale_checked_of_gradients_in_an_autograd_graph_does_not_write_them():
    leaf = torch.ones(3, requires_grad=True)
    grad = leaf * 4.0
    out, finite, _, _ = _checked([grad], 2.0)
    assert finite and out[0].tolist() == [2.0] * 3 and grad.tolist() == [4.0] * 3


def test_compiled_finite_check_finds_one_bad_value_in_packed_and_lone_tensors(monkeypatch):
    # Under torch.compile, small tensors are concatenated and checked at
    # once; tensors of PACK_BELOW elements or more, and those past the
    # capacity, alone. Sizes on both sides of both thresholds, in float32
    # and bfloat16 groups; the bad value first, last and at a random place.
    below = 64
    monkeypatch.setattr(torch_multi, "PACK_BELOW", below)
    monkeypatch.setattr(torch_multi, "PACK_CAPACITY", 2 * below)
    sizes = [below - 1, 1, below, below + 1, 60, 7, 3]  # 7 would pass the capacity: alone
    assert torch_multi.split_small([torch.empty(n) for n in sizes]) == ([0, 1, 4, 6], [2, 3, 5])
    check = torch.compile(lambda arrays: torch_multi.finite_flags(arrays), fullgraph=True)
    rng = np.random.default_rng(17)
    dtypes = [torch.float32] * len(sizes) + [torch.bfloat16, torch.bfloat16]
    start = [torch.tensor(rng.normal(size=n)).to(d) for n, d in zip(sizes + [5, below], dtypes)]
    finite, skip = check([a.clone() for a in start])
    assert bool(finite) and float(skip) == 0.0
    for k, a in enumerate(start):
        for at in sorted({0, a.numel() - 1, int(rng.integers(a.numel()))}):
            for bad in (np.inf, -np.inf, np.nan):
                arrays = [b.clone() for b in start]
                arrays[k][at] = bad
                finite, skip = check(arrays)
                assert not bool(finite) and float(skip) == 1.0, (k, at, bad)


def test_compiled_peak_packs_small_tensors_and_finds_one_bad_value(monkeypatch):
    # `finite_unscaled` (the compiled step's check where the kernel takes the
    # scale): small tensors concatenated into one reduction while tracing,
    # the others alone; the peak equals the eager one exactly, and one inf
    # or NaN anywhere, or a finite value that overflows when divided by a
    # scale under 1, is found.
    below = 64
    monkeypatch.setattr(torch_multi, "PACK_BELOW", below)
    monkeypatch.setattr(torch_multi, "PACK_CAPACITY", 2 * below)
    sizes = [below - 1, 1, below, below + 1, 60, 7, 3]
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    peak = torch.compile(lambda arrays: torch_multi.max_abs(arrays), fullgraph=True)
    check = torch.compile(
        lambda arrays, scale: torch_multi.finite_unscaled(arrays, scale),
        fullgraph=True,
        backend=capture,
    )
    rng = np.random.default_rng(19)
    start = [torch.tensor(rng.normal(size=n), dtype=torch.float32) for n in sizes]
    assert torch.equal(peak([a.clone() for a in start]), torch_multi.max_abs(start))
    assert bool(check([a.clone() for a in start], torch.tensor(2.0**15)))
    (graph,) = graphs
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert sum("cat" in t for t in targets) == 1, targets
    assert sum("aminmax" in t for t in targets) == 4, targets  # 3 alone, 1 packed
    for k, a in enumerate(start):
        for at in sorted({0, a.numel() - 1, int(rng.integers(a.numel()))}):
            for bad in (np.inf, -np.inf, np.nan):
                arrays = [b.clone() for b in start]
                arrays[k][at] = bad
                assert not bool(check(arrays, torch.tensor(2.0**15))), (k, at, bad)
            arrays = [b.clone() for b in start]
            arrays[k][at] = 3e38  # finite; past float32's maximum once divided by 1/4
            assert bool(check(arrays, torch.tensor(4.0)))
            assert not bool(check(arrays, torch.tensor(0.25))), (k, at)


@pytest.mark.parametrize("inner", ["lossscale_adam", "torch_sparse_adam"])
@pytest.mark.parametrize("scale", [2.0**10, 10.0], ids=["one_pass", "divide_then_check"])
def test_a_sparse_gradient_is_refused_by_name_and_nothing_is_written(inner, scale):
    import lossscale as ls

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50_000, 64, sparse=True)
    head = torch.nn.Linear(64, 1)
    params = [embedding.weight, *head.parameters()]
    make = {
        "lossscale_adam": lambda: ls.optimizers.Adam(0.01),
        "torch_sparse_adam": lambda: torch.optim.SparseAdam([embedding.weight], lr=0.01),
    }[inner]
    opt = ls.LossScaleOptimizer(make(), initial_scale=scale)
    ids = torch.randint(0, 50_000, (512,), generator=torch.Generator().manual_seed(1))
    opt.scale_loss(head(embedding(ids)).square().mean()).backward()
    before = [p.detach().clone() for p in params]
    used = params if inner == "lossscale_adam" else params[:1]
    with pytest.raises(
        ValueError,
        match=r"lossscale's optimizers take dense torch gradients\. For a sparse one .*"
        r"use lossscale\.torch\.GradScaler .* Received: a torch\.sparse_coo gradient of shape "
        r"\(50000, 64\)",
    ):
        opt.apply([p.grad for p in used], used)
    assert all(torch.equal(p, q) for p, q in zip(params, before))


def test_overlapping_views_are_divided_in_copies_disjoint_ones_in_place():
    """In place, the elements two views share would be divided twice."""
    for views, in_place in (
        (lambda b: [b[:4], b[2:]], False),  # elements 2 and 3 in both
        (lambda b: [b[:3], b[3:]], True),  # a flat gradient buffer's views
    ):
        base = torch.full((6,), 32768.0)
        params = [torch.zeros(len(v)) for v in views(base)]
        ls.LossScaleOptimizer(ls.optimizers.SGD(1.0)).apply(views(base), params)
        assert all(torch.equal(p, -torch.ones_like(p)) for p in params)
        assert torch.equal(base, torch.full((6,), 1.0 if in_place else 32768.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [None, "nan", "inf", "-inf"])
def test_peaks_are_each_tensor_s_largest_magnitude_bit_for_bit(dtype, bad):
    # The reference: torch's multi-tensor inf-norm (what the CPU path replaces), and
    # float64 NumPy; sizes from one element to a 1M-element weight, mixed dtypes.
    rng = np.random.default_rng(3)
    shapes = [(1,), (7,), (4097,), (256, 1024), (1024, 1024)]
    tensors = [
        torch.from_numpy(rng.standard_normal(s) * 10.0 ** rng.uniform(-3, 3, s)).to(dtype)
        for s in shapes
    ]
    tensors.append(torch.from_numpy(rng.standard_normal(300)).to(torch.float32))  # another group
    if bad is not None:
        value = float(bad)
        for t, where in zip(tensors, ["first", "last", "random", "random", "last", "first"]):
            flat = t.view(-1)
            position = {"first": 0, "last": flat.numel() - 1}.get(where)
            flat[int(rng.integers(flat.numel())) if position is None else position] = value
    got = torch_multi.peaks(tensors)
    reference = [torch._foreach_norm([t], float("inf"))[0] for t in tensors]
    for t, g, r in zip(tensors, got, reference):
        assert g.dtype == t.dtype and g.shape == ()
        assert torch.equal(g, r) or (g.isnan() and r.isnan()), (g, r)
        expected = np.abs(t.double().numpy()).max()
        if bad == "nan":
            assert np.isnan(float(g))
        else:
            assert float(g) == expected
