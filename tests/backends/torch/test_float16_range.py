"""backends/torch/float16_range.py: many gradients' float16 range, bit for bit `measure`'s."""

import threading

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends import torch as torch_ops
from lossscale.backends.torch import float16_range
from lossscale.backends.torch import multi as torch_multi
from lossscale.bench import workloads
from lossscale.mixed_precision import diagnostics
from tests.float16_range_cases import EDGES, SUBNORMAL, gradient_values

PACK_BELOW, CAPACITY = torch_multi.PACK_BELOW, torch_multi.PACK_CAPACITY


def _gradient(rng, shape, dtype, growth_factor):
    """Random magnitudes across float16's range, every class present, at random places."""
    values = gradient_values(rng, int(np.prod(shape)), growth_factor)
    return torch.from_numpy(values).to(dtype).reshape(shape)


@pytest.fixture(autouse=True, params=["counted on the host", "device histogram"])
def counting(request, monkeypatch):
    """Every test on both ways of counting: NumPy's on the CPU, and the
    histogram a GPU runs (on the CPU too once no host read is allowed)."""
    if request.param == "device histogram":
        monkeypatch.setattr(torch_multi, "HOST_READABLE", frozenset())
    return request.param


def _assert_as_measure(grads, growth_factor):
    out = float16_range.measure(grads, SUBNORMAL, diagnostics.near_max_limit(growth_factor))
    assert out is not None
    for column in out:
        assert column.dtype == torch.float32 and column.shape == (len(grads),)
    for i, g in enumerate(grads):
        expected = diagnostics.measure(torch_ops, g, growth_factor)
        for key, got, want in zip(diagnostics.KEYS, (col[i] for col in out), expected):
            assert torch.equal(got, want) or (got.isnan() and want.isnan()), (i, key, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("growth_factor", [2.0, 3.0])
def test_tiny_gradients_match_measure(dtype, growth_factor):
    rng = np.random.default_rng(0)
    grads = [_gradient(rng, s, dtype, growth_factor) for s in workloads.TRANSFORMER]
    _assert_as_measure(grads, growth_factor)


@pytest.mark.parametrize(
    "sizes",
    [
        [PACK_BELOW - 1, PACK_BELOW, PACK_BELOW + 1, 7],  # both sides of the packing threshold
        [PACK_BELOW - 1] * 3,
        [1, 1],
        [5],  # one gradient, alone
        [PACK_BELOW - 1],
        [3 * PACK_BELOW + 5, 2],
    ],
)
def test_sizes_on_both_sides_of_the_packing_threshold_match_measure(sizes):
    rng = np.random.default_rng(len(sizes))
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    grads = [_gradient(rng, (n,), dtypes[i % 3], 2.0) for i, n in enumerate(sizes)]
    _assert_as_measure(grads, 2.0)


def test_past_the_packing_capacity_gradients_are_measured_alone(monkeypatch):
    monkeypatch.setattr(torch_multi, "PACK_CAPACITY", 300)
    rng = np.random.default_rng(3)
    # 100 + 199 + 1 fill the capacity exactly; the next small ones do not fit.
    grads = [_gradient(rng, (n,), torch.float32, 2.0) for n in (100, 199, 1, 150, 1)]
    assert float16_range._chunks(grads) == ([0, 1, 2], [3, 4])
    _assert_as_measure(grads, 2.0)


def test_a_gradient_of_one_value_everywhere():
    for value in EDGES + [1.0, 65504.0, -7e4]:
        grads = [torch.full((33, 3), value), torch.full((65,), value).half()]
        _assert_as_measure(grads, 2.0)


def test_other_gradients_are_left_to_measure():
    assert float16_range.measure([], SUBNORMAL, 1.0) is None
    if torch.cuda.is_available():
        grads = [torch.ones(3), torch.ones(3, device="cuda")]
        assert float16_range.measure(grads, SUBNORMAL, 1.0) is None


def test_a_due_step_dispatches_a_fixed_number_of_operations():
    """Not about thirty per gradient as `measure` alone: 37 more than a plain step, for 28 and 56."""
    from tests.torch_cases import count_ops

    counts = []
    for copies in (1, 2):
        shapes = workloads.TRANSFORMER * copies
        rng = np.random.default_rng(0)
        params = [torch.from_numpy(rng.normal(size=s)).float() for s in shapes]
        grads = [torch.from_numpy(rng.normal(size=s)).float() * 1e-3 for s in shapes]
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(), diagnostics_every=2)
        opt.scale_loss(1.0)
        opt.apply([g.clone() for g in grads], params)
        opt.apply([g.clone() for g in grads], params)  # not due
        with count_ops() as due:
            opt.apply([g.clone() for g in grads], params)
        with count_ops() as plain:
            opt.apply([g.clone() for g in grads], params)
        counts.append((len(due), len(plain)))
    (due_28, plain_28), (due_56, plain_56) = counts
    assert due_28 - plain_28 == due_56 - plain_56 <= 37


def test_gradients_from_the_packing_threshold_on_are_measured_alone():
    grads = [torch.zeros(n) for n in (PACK_BELOW - 1, PACK_BELOW, 3, PACK_BELOW + 1)]
    assert float16_range._chunks(grads) == ([0, 2], [1, 3])
    assert float16_range._chunks(grads[:2]) == ([], [0, 1])  # one small one: alone too


# Three gradients of 3,825 elements packed: a class with fewer than 3825 / 16
# members (239 or fewer) is counted member by member, else by sums.
_SIZES = (1000, 777, 2048)
_PACKED = sum(_SIZES)
_BOUNDARY = _PACKED // float16_range._SPARSE_BELOW


@pytest.mark.parametrize(
    "members", [0, 1, 2, _BOUNDARY - 1, _BOUNDARY, _BOUNDARY + 1, _PACKED // 2, _PACKED]
)
@pytest.mark.parametrize("value", [0.0, -1e-6, 6e4, float("inf"), float("nan")])
@pytest.mark.parametrize("with_nan", [False, True])
def test_few_and_many_members_of_a_class_match_measure(members, value, with_nan):
    """Both ways of counting a class (by member, by sums), at the edges and at random places.

    The other classes absent (their counts skipped), or a NaN at a random
    place besides (the near-maximum count then excludes NaN by range).
    """
    rng = np.random.default_rng(members)
    flat = rng.uniform(0.5, 2.0, _PACKED) * rng.choice([-1.0, 1.0], _PACKED)
    # The pack's ends and each gradient's first and last elements first.
    ends = np.cumsum(_SIZES)
    edges = [0, _PACKED - 1, *ends[:-1], *(ends[:-1] - 1)]
    places = np.concatenate([edges, rng.permutation(np.setdiff1d(np.arange(_PACKED), edges))])
    flat[places[:members]] = value
    if with_nan:
        flat[rng.integers(_PACKED)] = float("nan")
    grads = [torch.from_numpy(x).float() for x in np.split(flat, ends[:-1])]
    _assert_as_measure(grads, 2.0)
    _assert_as_measure([grads[0]], 2.0)  # one gradient: measured alone


def test_counting_a_mask_per_tensor_on_both_sides_of_the_sparse_boundary():
    rng = np.random.default_rng(5)
    starts = np.concatenate([[0], np.cumsum(_SIZES)[:-1]])
    for members in (0, 1, _BOUNDARY - 1, _BOUNDARY, _BOUNDARY + 1, _PACKED):
        mask = np.zeros(_PACKED, bool)
        mask[rng.permutation(_PACKED)[:members]] = True
        expected = [np.count_nonzero(part) for part in np.split(mask, starts[1:])]
        assert float16_range._per_tensor(mask, starts).tolist() == expected


# A gradient measured alone is read `PACK_CAPACITY` elements at a time
# (made small here): sizes on both sides of one and of several chunks, and
# layouts read in memory order (transposed, channels-last) or copied (a
# strided slice).
_CHUNK = 300


def _alone_cases(rng):
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    sizes = (299, 300, 301, 600, 601, 905)
    cases = [_gradient(rng, (n,), dtypes[i % 4], 2.0) for i, n in enumerate(sizes)]
    cases.append(_gradient(rng, (40, 25), torch.float32, 2.0).t())
    cases.append(
        _gradient(rng, (2, 5, 9, 11), torch.float16, 2.0).contiguous(
            memory_format=torch.channels_last
        )
    )
    cases.append(_gradient(rng, (30, 40), torch.float32, 2.0)[:, ::3])
    return cases


def test_a_gradient_past_the_capacity_is_measured_in_chunks_as_measure(monkeypatch):
    monkeypatch.setattr(torch_multi, "PACK_CAPACITY", _CHUNK)
    rng = np.random.default_rng(6)
    for grad in _alone_cases(rng):
        _assert_as_measure([grad], 2.0)
        _assert_as_measure([grad, torch.ones(7), torch.zeros(5)], 2.0)  # beside a pack
        # A NaN or an inf at a chunk's first and last element, and at the ends.
        flat = grad.reshape(-1)
        for place in (0, _CHUNK - 1, _CHUNK, flat.numel() - 1):
            for value in (float("nan"), float("inf"), 0.0):
                bad = flat.clone()
                bad[min(place, flat.numel() - 1)] = value
                _assert_as_measure([bad.reshape(grad.shape)], 2.0)


def test_a_gradient_of_any_size_is_measured_in_the_capacity_s_memory(monkeypatch):
    """No memory taken while measuring holds more than `PACK_CAPACITY` float32 numbers, on either path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {_storage(x) for x in torch.utils._pytree.tree_leaves((args, kwargs))}
            for x in torch.utils._pytree.tree_leaves(out):
                if isinstance(x, torch.Tensor) and _storage(x) not in given:  # made, not a view
                    self.largest = max(self.largest, x.untyped_storage().nbytes() // 4)
            return out

    monkeypatch.setattr(torch_multi, "PACK_CAPACITY", _CHUNK)
    monkeypatch.setattr(float16_range, "_BUFFERS", threading.local())  # none kept yet
    rng = np.random.default_rng(7)
    for grad in [_gradient(rng, (10 * _CHUNK + 7,), torch.float32, 2.0), *_alone_cases(rng)[:-1]]:
        with Largest() as made:
            float16_range.measure([grad], SUBNORMAL, 1e4)
        assert 0 < made.largest <= _CHUNK, (grad.shape, made.largest)


def _storage(x):
    return x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else None


def test_a_gradient_one_element_past_the_real_capacity_is_measured_as_measure():
    """At the capacity's real size (4M elements): two chunks, the second of one element."""
    rng = np.random.default_rng(8)
    grad = _gradient(rng, (CAPACITY + 1,), torch.float32, 2.0)
    _assert_as_measure([grad], 2.0)
    for place in (CAPACITY - 1, CAPACITY):
        bad = grad.clone()
        bad[place] = float("nan")
        _assert_as_measure([bad], 2.0)
