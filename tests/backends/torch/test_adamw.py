"""backends/torch/adamw.py: decoupled weight decay as Keras 3's torch backend does it.

Keras reads `KERAS_BACKEND` once, at import; every module of the suite that
imports Keras in-process sets the same value (torch).
"""

import os

os.environ["KERAS_BACKEND"] = "torch"

import functools  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import lossscale as ls  # noqa: E402
from lossscale.backends.torch import adamw as torch_adamw  # noqa: E402
from lossscale.backends.torch import kernels as torch_kernels  # noqa: E402
from lossscale.optimizers.weight_decay import (  # noqa: E402
    WeightDecayExclusions,
    apply_weight_decay,
)

# Magnitudes across the float range, odd sizes (the kernels' scalar tails).
SHAPES = [(3,), (5, 7), (1000,), (17, 33), (64,), (1,)]
STEPS = 6

# Optimizers whose update is exactly zero for a zero gradient, so that a run
# on zero gradients is their weight decay alone, compounded over the steps.
DECAYING = {
    "AdamW": dict(learning_rate=0.0923, weight_decay=0.371),
    "Adam": dict(learning_rate=0.0923, weight_decay=0.0371),
    "SGD": dict(learning_rate=0.0923, weight_decay=0.371, momentum=0.9),
    "Lion": dict(learning_rate=0.0923, weight_decay=0.371),
    "RMSprop": dict(learning_rate=0.0923, weight_decay=0.371),
}


def bits(t):
    return t.reshape(-1).view(torch.uint8)


def start_values(dtype, seed=11):
    rng = np.random.default_rng(seed)
    values = [rng.normal(size=s) * 10.0 ** rng.integers(-3, 3, size=s) for s in SHAPES]
    values[0][:2] = [-0.0, 0.0]
    return [v.astype(dtype) for v in values]


def test_the_registry_names_this_kernel():
    assert torch_kernels.fused_weight_decay() is torch_adamw.weight_decay


@functools.cache
def keras_decayed(name, dtype):
    """Keras 3 on torch: the variables after `STEPS` steps of zero gradients."""
    variables = [
        keras.Variable(v, dtype=dtype, name=f"w{i}") for i, v in enumerate(start_values(dtype))
    ]
    optimizer = getattr(keras.optimizers, name)(**DECAYING[name])
    for _ in range(STEPS):
        optimizer.apply([keras.ops.zeros(v.shape, dtype=dtype) for v in variables], variables)
    return [v.numpy() for v in variables]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", sorted(DECAYING))
def test_weight_decay_is_keras_on_torch_bit_for_bit(name, dtype):
    # float32 parameters take the fused kernels (Adam, SGD), float16 ones
    # the foreach rules: the decay is the same kernel before either.
    params = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in start_values(dtype)]
    optimizer = getattr(ls.optimizers, name)(**DECAYING[name])
    for _ in range(STEPS):
        optimizer.apply([torch.zeros_like(p) for p in params], params)
    for got, want in zip(params, keras_decayed(name, dtype)):
        assert torch.equal(bits(got.detach()), bits(torch.from_numpy(want))), name


def test_a_wrapped_adamw_with_a_skipped_step_is_keras_on_torch_bit_for_bit():
    def run(library, variables, to_tensor):
        optimizer = library.optimizers.LossScaleOptimizer(
            library.optimizers.AdamW(**DECAYING["AdamW"]), initial_scale=4.0
        )
        optimizer.scale_loss(1.0)  # (lossscale warns of gradients of an unscaled loss)
        for step in range(STEPS):
            grads = [np.zeros(v.shape, np.float32) for v in start_values("float32")]
            if step == 2:
                grads[3][4, 5] = np.inf  # the whole step is skipped, decay included
            optimizer.apply([to_tensor(g) for g in grads], variables)
        return [keras.ops.convert_to_numpy(v) for v in variables]

    k_vars = [keras.Variable(v, name=f"w{i}") for i, v in enumerate(start_values("float32"))]
    want = run(keras, k_vars, keras.ops.convert_to_tensor)
    params = [torch.from_numpy(v.copy()) for v in start_values("float32")]
    got = run(ls, params, torch.from_numpy)
    for a, b in zip(got, want):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def keras_on_torch_decay(value, weight_decay, lr):
    # What Keras's torch backend computes: one factor in the learning rate's
    # dtype, then one multiplication of every variable by it.
    factor = 1 - weight_decay * lr
    return value * factor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("skipped", [False, True], ids=["applied", "skipped"])
def test_weight_decay_under_keep_is_the_factor_or_nothing(dtype, skipped):
    # The rates are not powers of two, and the decay is a third of each
    # value: a factor off by an ulp shows in the product.
    start = [torch.from_numpy(v).to(dtype) for v in start_values("float64")]
    start[1][0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    lr = torch.tensor(0.923, dtype=torch.float32)
    params = [ls.Variable(x.clone()) for x in start]
    optimizer = ls.optimizers.AdamW(0.923, weight_decay=0.371)
    optimizer.build(params)
    ops = params[0]._ops
    keep = torch.tensor(not skipped)
    apply_weight_decay(ops, params, 0.371, lr, WeightDecayExclusions(), {}, keep=keep)
    for x, got in zip(start, params):
        want = x if skipped else keras_on_torch_decay(x, 0.371, lr)
        assert got.value.dtype == dtype
        assert torch.equal(bits(got.value), bits(want))


def test_weight_decay_without_keep_uses_one_kernel_per_group():
    from tests.torch_cases import count_ops

    params = [ls.Variable(torch.randn(4, 3)) for _ in range(16)]
    params += [ls.Variable(torch.randn(4, 3, dtype=torch.float16)) for _ in range(16)]
    optimizer = ls.optimizers.AdamW(0.01)
    optimizer.build(params)
    lr = torch.tensor(0.01)
    ops = params[0]._ops
    run = functools.partial(apply_weight_decay, ops, params, 0.004, lr, WeightDecayExclusions(), {})
    run()  # builds the plan and the factor
    with count_ops() as seen:
        run()
    # The factor is kept while the learning rate is the same tensor, unchanged.
    assert seen == ["aten._foreach_mul_.Tensor"] * 2


@pytest.mark.parametrize("change", ["in_place", "new_tensor", "weight_decay"])
def test_the_kept_factor_is_made_again_when_the_learning_rate_changes(change):
    # Each step's decay equals Keras-on-torch's with that step's rate, bit
    # for bit, whether the rate was written in place (a scheduler on a
    # Variable), replaced by another tensor (a schedule), or the rate of
    # decay itself moved (a param group's "weight_decay").
    start = [torch.from_numpy(v) for v in start_values("float32")]
    params = [ls.Variable(x.clone()) for x in start]
    want = [x.clone() for x in start]
    optimizer = ls.optimizers.AdamW(0.01)
    optimizer.build(params)
    ops, cache = params[0]._ops, {}
    lr, weight_decay = torch.tensor(0.0923), 0.371
    for step in range(4):
        if change == "in_place":
            lr.mul_(0.7)
        elif change == "new_tensor":
            lr = lr * 0.7
        else:
            weight_decay *= 0.7
        apply_weight_decay(ops, params, weight_decay, lr, WeightDecayExclusions(), cache)
        want = [keras_on_torch_decay(w, weight_decay, lr) for w in want]
        for got, w in zip(params, want):
            assert torch.equal(bits(got.value), bits(w)), step


def test_a_number_learning_rate_gives_a_number_factor():
    assert torch_adamw.decay_factor(0.5, 0.25) == 0.875
    factor = torch_adamw.decay_factor(0.371, torch.tensor(0.923))
    assert factor.dtype == torch.float32 and factor.shape == ()
