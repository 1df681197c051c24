"""The fused NumPy kernels equal the per-variable `update_step`, bit for bit.

Every case runs the same seeded steps twice: once with the kernel registered
in `numpy.kernels.KERNELS` (counting its calls, so no case passes
vacuously) and once with the entry removed, which sends `_update_variables`
down the generic per-variable path. Model and optimizer variables must then
be identical after every step. `small_blocks` shrinks the block sizes (of the
kernels and of the finite check) and forces several workers so that block
splitting and threading are exercised on small arrays.
"""

import gc
import tracemalloc
import warnings
import weakref

import numpy as np
import pytest

import lossscale as ls
from lossscale.backends.kernel import Kernel
from lossscale.backends.numpy import fused as numpy_fused
from lossscale.backends.numpy import kernels as numpy_kernels
from lossscale.backends.numpy import ops as numpy_ops
from lossscale.backends.numpy import parallel as numpy_parallel
from lossscale.optimizers import SGD, Adam, AdamW
from tests.conftest import force_numpy_threads

SHAPES = [(3, 4), (7,), (), (0, 3), (37, 29), (1500,)]

ADAM_CASES = [
    {},
    {"amsgrad": True},
    {"weight_decay": 0.01, "clipnorm": 1.0},
    {"amsgrad": True, "global_clipnorm": 0.5, "weight_decay": 0.004},
    {"clipvalue": 0.05, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-4},
    {"gradient_accumulation_steps": 2, "learning_rate": 0.01},
]
SGD_CASES = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "clipvalue": 0.5},
    {"momentum": 0.5, "nesterov": True, "global_clipnorm": 1.0},
    {"momentum": 0.7, "clipnorm": 0.3, "learning_rate": 0.1},
]
CASES = (
    [(Adam, c) for c in ADAM_CASES]
    + [(AdamW, {"weight_decay": 0.01})]
    + [(SGD, c) for c in SGD_CASES]
)


@pytest.fixture(params=["default_blocks", "small_blocks"])
def blocks(request, monkeypatch):
    if request.param == "small_blocks":
        monkeypatch.setattr(numpy_fused, "BLOCK", 64)
        monkeypatch.setattr(numpy_fused, "PACK_BELOW", 16)
        monkeypatch.setattr(numpy_fused, "PACK_CAPACITY", 48)
        # The wrapper's finite check in blocks too (`parallel.peak_magnitude`).
        monkeypatch.setattr(numpy_parallel, "REDUCE_WHOLE_BELOW", 64)
        monkeypatch.setattr(numpy_parallel, "REDUCE_BLOCK", 100)
        force_numpy_threads(monkeypatch)
    return request.param


def _data(shapes, steps, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(steps)]
    return weights, grads


def _snapshot(opt, weights):
    return [np.array(w, copy=True) for w in weights] + [v.numpy().copy() for v in opt.variables]


def _run(monkeypatch, cls, make, weights, grads, fused):
    """Applies every step of `grads`; returns a snapshot after each and the kernel's calls."""
    calls = []
    with monkeypatch.context() as m:
        if fused:
            kernel = numpy_kernels.KERNELS[cls.update_kernel]

            def counting(*args, **kwargs):
                calls.append(kwargs.get("grad_scale"))
                return kernel(*args, **kwargs)

            m.setitem(
                numpy_kernels.KERNELS,
                cls.update_kernel,
                Kernel(counting, takes_grad_scale=kernel.takes_grad_scale),
            )
        else:
            m.delitem(numpy_kernels.KERNELS, cls.update_kernel)
        opt = make()
        weights = [w.copy() for w in weights]
        snapshots = []
        for step in grads:
            opt.apply([g.copy() for g in step], weights)
            snapshots.append(_snapshot(opt, weights))
    return snapshots, calls


def _assert_same(monkeypatch, cls, make, weights, grads):
    """Asserts fused == generic after every step; returns the kernel calls' grad_scale."""
    fused, calls = _run(monkeypatch, cls, make, weights, grads, fused=True)
    generic, generic_calls = _run(monkeypatch, cls, make, weights, grads, fused=False)
    assert calls and not generic_calls
    for step, (a, b) in enumerate(zip(fused, generic)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y, err_msg=f"step {step}, array {i}")
    return calls


def test_registered_for_exact_classes_only():
    assert numpy_kernels.KERNELS == {
        "adam": Kernel(numpy_fused.adam, takes_grad_scale=True),
        "sgd": Kernel(numpy_fused.sgd, takes_grad_scale=True),
    }
    assert Adam()._fused_kernel().fn is numpy_fused.adam
    assert AdamW()._fused_kernel().fn is numpy_fused.adam  # the same rule, declared again
    assert SGD()._fused_kernel().fn is numpy_fused.sgd

    class Changed(Adam):  # a subclass may change the rule: it gets the generic path
        pass

    assert Changed()._fused_kernel() is None
    assert numpy_kernels.fused_update("no such kernel") is None


@pytest.mark.parametrize("cls,config", CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_fused_equals_update_step(monkeypatch, blocks, cls, config):
    weights, grads = _data(SHAPES, steps=4)
    _assert_same(monkeypatch, cls, lambda: cls(**config), weights, grads)


@pytest.mark.parametrize("cls,config", CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_fused_equals_update_step_under_loss_scaling(monkeypatch, blocks, cls, config):
    scale = 2.0**10
    weights, grads = _data(SHAPES, steps=7, seed=1)
    grads = [[g * np.float32(scale) for g in step] for step in grads]
    grads[1][4][3, 5] = np.inf  # overflow: skipped, scale halves
    grads[3][0][1, 2] = np.nan
    grads[4][5][-1] = -np.inf
    grads[4][1][0] = np.nan

    def make():
        opt = ls.LossScaleOptimizer(cls(**config), initial_scale=scale, dynamic_growth_steps=2)
        opt.scale_loss(np.float32(1.0))  # as a training step would, before differentiating
        return opt

    scales = _assert_same(monkeypatch, cls, make, weights, grads)
    # Without clipping or accumulation the wrapper hands its scale to the
    # kernel instead of unscaling first; with them it unscales.
    folds = not (
        {"clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps"} & set(config)
    )
    assert all((s is not None) == folds for s in scales)


@pytest.mark.parametrize(
    "cls,config", [(Adam, {"amsgrad": True}), (SGD, {"momentum": 0.9, "nesterov": True})]
)
@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_other_float_dtypes(monkeypatch, blocks, cls, config, dtype):
    weights, grads = _data(SHAPES, steps=3, dtype=dtype, seed=2)
    _assert_same(monkeypatch, cls, lambda: cls(**config), weights, grads)


@pytest.mark.parametrize("cls,config", [(Adam, {}), (SGD, {"momentum": 0.9})])
def test_mixed_dtypes_and_half_gradients(monkeypatch, blocks, cls, config):
    # float32 and float64 variables in one optimizer, float16 gradients for
    # the float32 ones (cast like `update_step` casts them).
    rng = np.random.default_rng(3)
    weights = [
        rng.standard_normal((40, 9)).astype("float32"),
        rng.standard_normal((300,)).astype("float64"),
    ]
    grads = [
        [
            rng.standard_normal((40, 9)).astype("float16"),
            rng.standard_normal((300,)).astype("float64"),
        ]
        for _ in range(3)
    ]
    _assert_same(monkeypatch, cls, lambda: cls(**config), weights, grads)


@pytest.mark.parametrize("cls,config", [(Adam, {"amsgrad": True}), (SGD, {"momentum": 0.9})])
def test_strided_arrays_take_update_step(monkeypatch, blocks, cls, config):
    rng = np.random.default_rng(4)
    weights = [
        np.asfortranarray(rng.standard_normal((30, 20)).astype("float32")),
        rng.standard_normal((500,)).astype("float32"),
    ]
    grads = [
        [
            rng.standard_normal((30, 20)).astype("float32")[:, ::-1],
            rng.standard_normal((1000,)).astype("float32")[::2],
        ]
        for _ in range(3)
    ]
    _assert_same(monkeypatch, cls, lambda: cls(**config), weights, grads)


def test_learning_rate_callable_and_schedule(monkeypatch, blocks):
    weights, grads = _data(SHAPES, steps=3, seed=5)
    schedule = ls.schedules.ExponentialDecay(0.01, decay_steps=1, decay_rate=0.5)
    _assert_same(monkeypatch, Adam, lambda: Adam(learning_rate=schedule), weights, grads)
    _assert_same(
        monkeypatch, SGD, lambda: SGD(learning_rate=lambda: 0.02, momentum=0.3), weights, grads
    )


@pytest.mark.parametrize(
    "cls,config",
    [(Adam, {"amsgrad": True}), (Adam, {}), (SGD, {"momentum": 0.9, "nesterov": True}), (SGD, {})],
)
def test_grad_scale_equals_unscaling_first(blocks, cls, config):
    # A kernel given the loss scale divides each block in cache; the result
    # must equal unscaling the whole gradients first (`numpy_ops.unscale`).
    rng = np.random.default_rng(9)
    weights = [
        rng.standard_normal((40, 9)).astype("float32"),
        rng.standard_normal((300,)).astype("float64"),
        np.asfortranarray(rng.standard_normal((20, 30)).astype("float32")),
        rng.standard_normal((1200,)).astype("float32"),
    ]
    grads = [
        rng.standard_normal((40, 9)).astype("float16"),
        rng.standard_normal((300,)).astype("float64"),
        rng.standard_normal((20, 30)).astype("float32"),
        rng.standard_normal((1200,)).astype("float32"),
    ]
    scale = np.asarray(np.float32(3.0))  # not a power of two: division rounds
    results = []
    for fused_scale in (True, False):
        opt = cls(**config)
        variables = [ls.Variable(w.copy(order="K")) for w in weights]
        opt.build(variables)
        assert opt._fused_kernel().takes_grad_scale
        for _ in range(2):
            if fused_scale:
                opt._update_variables(grads, variables, opt.learning_rate, grad_scale=scale)
            else:
                opt._update_variables(numpy_ops.unscale(grads, scale), variables, opt.learning_rate)
            opt.iterations.assign_add(1)
        results.append([v.numpy() for v in variables + opt.variables])
    for x, y in zip(*results):
        np.testing.assert_array_equal(x, y)


def test_stateless_apply_matches_and_mutates_nothing(monkeypatch, blocks):
    weights, grads = _data(SHAPES, steps=1, seed=6)
    results = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.delitem(numpy_kernels.KERNELS, "adam")
            opt = ls.LossScaleOptimizer(Adam(amsgrad=True), initial_scale=4.0)
            opt.scale_loss(np.float32(1.0))
            opt.build(weights)
            before = _snapshot(opt, weights)
            new_weights, new_state = opt.stateless_apply(
                [v.numpy() for v in opt.variables], [g * np.float32(4) for g in grads[0]], weights
            )
            for x, y in zip(before, _snapshot(opt, weights)):
                np.testing.assert_array_equal(x, y)
            results.append([np.asarray(a) for a in new_weights + new_state])
    for x, y in zip(*results):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(results[0][4], weights[4])


def test_non_finite_gradients_without_loss_scaling_stay_quiet(monkeypatch, blocks):
    # `apply` silences NumPy's floating-point warnings; the worker threads
    # must inherit that.
    weights, grads = _data([(50, 50)], steps=2, seed=7)
    grads[0][0][0, 0] = np.inf
    grads[1][0][1, 1] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_same(monkeypatch, Adam, Adam, weights, grads)


def test_kernel_allocates_no_full_size_temporaries():
    n = 1 << 20
    rng = np.random.default_rng(8)
    weights = [rng.standard_normal(n).astype("float32") for _ in range(3)]
    grads = [rng.standard_normal(n).astype("float32") for _ in range(3)]
    for opt in (Adam(amsgrad=True), SGD(momentum=0.9, nesterov=True)):
        opt.apply(grads, weights)  # builds; the scratch buffers are made here
        variables = opt._trainable_variables
        tracemalloc.start()
        try:
            opt._update_variables(grads, variables, opt.learning_rate)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < n * 4 // 8, f"{type(opt).__name__} allocated {peak} bytes"


def test_scratch_belongs_to_the_optimizer(monkeypatch):
    monkeypatch.setattr(numpy_parallel, "cpu_count", lambda: 1)
    weights, grads = _data([(5, 5)], steps=1)
    opt = Adam()
    opt.apply(grads[0], weights)
    buffers = opt._kernel_cache[numpy_fused.SCRATCH_KEY]
    assert {key[1] for key in buffers} == {np.dtype("float32")}
    for group in buffers.values():
        assert [t.shape for t in group] == [(numpy_fused.BLOCK,)] * 3 + [
            (numpy_fused.PACK_CAPACITY,)
        ] * (1 + numpy_fused.MAX_ARRAYS)
    opt.apply(grads[0], weights)
    assert opt._kernel_cache[numpy_fused.SCRATCH_KEY] is buffers
    alive, kept = weakref.ref(opt), weakref.ref(buffers[0, np.dtype("float32")][0])
    del opt, buffers, group
    gc.collect()
    assert alive() is None and kept() is None  # the buffers die with their optimizer


def test_blocks_split_large_jobs_and_pack_small_ones(monkeypatch):
    monkeypatch.setattr(numpy_fused, "BLOCK", 64)
    monkeypatch.setattr(numpy_fused, "PACK_BELOW", 16)
    same, other = object(), object()

    def job(n, constants=same, arrays=2, dtype="float32"):
        return (np.empty(n, dtype), [np.empty(n, dtype)] * arrays, constants, None)

    jobs = [
        job(10),
        job(300),
        job(0),
        job(70),
        job(15),
        job(15, other),
        job(15),
        job(12, arrays=5),
        job(9, dtype="float64"),
        job(20),
        job(15),
        job(15),
    ]
    blocks = numpy_fused._blocks(jobs)
    assert blocks == [
        (1, 0, 64),
        (1, 64, 128),
        (1, 128, 192),
        (1, 192, 256),
        (1, 256, 300),  # cut
        (3, 0, 64),
        (3, 64, 70),
        ((0, 2, 4), 0, 25),  # closed by job 5's other constants
        (5, 0, 15),  # alone: job 6 differs from it
        (7, 0, 12),  # too many arrays to pack
        (6, 0, 15),  # alone: job 8 has another dtype
        (9, 0, 20),  # not small
        (8, 0, 9),
        ((10, 11), 0, 30),
    ]
    covered = sorted(i for b in blocks for i in (b[0] if isinstance(b[0], tuple) else (b[0],)))
    assert sorted(set(covered)) == list(range(len(jobs)))
    for members, start, stop in blocks:
        if isinstance(members, tuple):
            group = [jobs[i] for i in members]
            assert len(members) > 1 and stop - start == sum(g.size for g, *_ in group) <= 64
            assert len({(g.dtype, id(c), len(a)) for g, a, c, _ in group}) == 1
            assert all(g.size < 16 for g, *_ in group)
        else:
            assert 0 <= stop - start <= 64
    assert sum(stop - start for _, start, stop in blocks) == sum(j[0].size for j in jobs)


def test_small_variables_are_packed_with_and_without_grad_scale(monkeypatch):
    rng = np.random.default_rng(10)
    weights = [rng.standard_normal(n).astype("float32") for n in (5, 30, 7, 100, 64)]
    grads = [rng.standard_normal(w.shape).astype("float32") for w in weights]
    gathered = []
    gather = numpy_fused._gather
    monkeypatch.setattr(
        numpy_fused,
        "_gather",
        lambda jobs, *args: gathered.append(len(jobs)) or gather(jobs, *args),
    )
    opt = Adam()
    opt.build(weights)
    variables = opt._trainable_variables
    opt._update_variables(grads, variables, opt.learning_rate)
    opt._update_variables(
        grads, variables, opt.learning_rate, grad_scale=np.asarray(np.float32(8.0))
    )
    assert gathered == [5, 5]  # one pack of all five, both times


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "scale,multiplies",
    [
        (2.0**15, True),
        (1.0, True),
        (2.0**-126, True),  # the dynamic scale's lower limit (float32 tiny)
        (2.0**-127, True),  # a subnormal float32 scale: 2**127 is still finite
        (2.0**127, True),  # reciprocal subnormal in float32, exact
        (2.0**-149, None),  # float32: its reciprocal overflows, so it is divided by
        (3.0, False),
        (1000.0, False),
        (2.0**15 * 1.5, False),
    ],
)
def test_unscaler_multiplies_by_exact_reciprocals_only(dtype, scale, multiplies):
    # Multiplying by the reciprocal must give `g / scale` bit for bit,
    # subnormal, overflowing and non-finite values included.
    rng = np.random.default_rng(11)
    info = np.finfo(dtype)
    g = np.concatenate(
        [
            rng.standard_normal(500),
            rng.standard_normal(500) * float(info.tiny) * 2.0**20,  # subnormal when unscaled
            rng.uniform(-1, 1, 200) * float(info.max),  # may overflow when unscaled
            [0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), float(info.smallest_subnormal)],
        ]
    ).astype(dtype)
    scale = np.asarray(np.float64(scale)).astype("float32")  # the wrapper's float32 scale
    if multiplies is None:
        multiplies = dtype == "float64"
    ufunc, operand = numpy_fused._unscaler(scale, np.dtype(dtype))
    assert ufunc is (np.multiply if multiplies else np.divide)
    assert operand.dtype == np.dtype(dtype) and operand.shape == ()
    with np.errstate(all="ignore"):
        got, expected = ufunc(g, operand), g / scale.astype(dtype)
    bits = "uint32" if dtype == "float32" else "uint64"
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(bits), expected[~nan].view(bits))


def test_blocks_are_updated_last_to_first_after_a_first_to_last_check(monkeypatch):
    # The order is for the cache (the check leaves the last gradients in it),
    # never for the result: every block is taken once.
    monkeypatch.setattr(numpy_fused, "BLOCK", 64)
    monkeypatch.setattr(numpy_parallel, "REDUCE_WHOLE_BELOW", 64)
    monkeypatch.setattr(numpy_parallel, "REDUCE_BLOCK", 64)
    orders = []
    share = numpy_parallel.share
    monkeypatch.setattr(
        numpy_parallel,
        "share",
        lambda work, items, count: orders.append(list(items)) or share(work, items, count),
    )
    weights, grads = _data([(300,), (200,)], steps=1, seed=12)
    opt = ls.LossScaleOptimizer(Adam(), initial_scale=2.0)
    opt.scale_loss(np.float32(1.0))
    opt.apply([g * np.float32(2) for g in grads[0]], weights)
    check, update = orders
    assert check == [
        (j, s, min(s + 64, n)) for j, n in enumerate((300, 200)) for s in range(0, n, 64)
    ]
    assert update == numpy_fused._blocks([(g.ravel(), [g], None, None) for g in grads[0]])[::-1]


@pytest.mark.parametrize("cls,config", [(Adam, {"amsgrad": True}), (SGD, {"momentum": 0.9})])
@pytest.mark.parametrize(
    "scale,bad",
    [
        (2.0**10, [(0, (0, 0), np.inf), (6, (2999,), np.nan)]),  # first and last block
        (2.0**10, [(6, (2999,), np.nan)]),  # the block the kernel would take first
        (2.0**10, [(6, (1500,), -np.inf)]),
        (2.0**-10, [(4, (3, 5), 3e38)]),  # finite, but overflows once unscaled
    ],
)
def test_skipped_step_leaves_every_variable_unchanged(monkeypatch, blocks, cls, config, scale, bad):
    weights, grads = _data(SHAPES + [(3000,)], steps=2, seed=13)
    grads = [[g * np.float32(scale) for g in step] for step in grads]
    for i, index, value in bad:
        grads[1][i][index] = value
    calls = []
    kernel = numpy_kernels.KERNELS[cls.update_kernel]

    def counting(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setitem(
        numpy_kernels.KERNELS, cls.update_kernel, Kernel(counting, takes_grad_scale=True)
    )
    opt = ls.LossScaleOptimizer(cls(**config), initial_scale=scale)
    opt.scale_loss(np.float32(1.0))
    opt.apply(grads[0], weights)  # an applied step: moments are not zero
    assert calls == [1]
    inner = opt.inner_optimizer
    before = [w.copy() for w in weights] + [v.numpy().copy() for v in inner.variables]
    opt.apply(grads[1], weights)
    assert calls == [1]  # the kernel never ran
    after = list(weights) + [v.numpy() for v in inner.variables]
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))
    assert float(opt.dynamic_scale) == scale / 2
