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


# --- the decay folded into torch's fused AdamW kernel (float32, on the CPU) ---------

# Real sizes (a tensor past `multi.PACK_BELOW` among them), and small odd ones.
FOLD_SHAPES = [(300, 250), (70001,), (17, 33), (5,), ()]

# Runs of a wrapped AdamW, each a setting that moves a branch of the fold.
# "inexact": `wd * lr` near 2/3, where the float32 factor's last place is
# finer than the kernel's rate can be set for some step sizes: those steps
# decay on their own.
FOLD_CASES = {
    "float32": dict(dtype="float32"),
    "float64": dict(dtype="float64"),
    "float16": dict(dtype="float16"),
    "bfloat16": dict(dtype="bfloat16"),
    "excluded": dict(dtype="float32", exclude=(1, 3)),
    "all_excluded": dict(dtype="float32", exclude=(0, 1, 2, 3, 4)),
    "rate_zero": dict(dtype="float32", learning_rate=0.0),
    "schedule": dict(dtype="float32", schedule=True),
    "lr_in_place": dict(dtype="float32", lr_steps=(0.05, 0.02, 0.3, 0.3, 0.001, 0.0)),
    "weight_decay_changed": dict(dtype="float32", wd_steps=(0.1, 0.5, 0.5, 0.0, 0.02, 1.0)),
    "inexact": dict(dtype="float32", learning_rate=0.5, weight_decay=1.3),
}


def fold_run(library, case, to_tensor, make_variable, zero_grads):
    """Six steps of a wrapped AdamW (the third skipped), with the case's settings.

    With `zero_grads` the Adam update is exactly zero and each step is its
    decay alone: torch's fused Adam kernel rounds its update differently
    from Keras-on-torch's multi-tensor one (see `fused`), its decay not.
    Returns the variables' final values as torch tensors (bfloat16 ones cast
    to float32, exactly, for NumPy).
    """
    settings = FOLD_CASES[case]
    dtype = settings["dtype"]
    rng = np.random.default_rng(23)
    start = [np.asarray(rng.normal(size=s), np.float32) for s in FOLD_SHAPES]
    variables = [make_variable(v, dtype, f"w{i}") for i, v in enumerate(start)]
    rate = settings.get("learning_rate", 0.05)
    if settings.get("schedule"):
        schedules = keras.optimizers.schedules if library is keras else ls.schedules
        rate = schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.7)
    inner = library.optimizers.AdamW(
        learning_rate=rate, weight_decay=settings.get("weight_decay", 0.1)
    )
    if "exclude" in settings:
        inner.exclude_from_weight_decay(var_list=[variables[i] for i in settings["exclude"]])
    optimizer = library.optimizers.LossScaleOptimizer(inner, initial_scale=4.0)
    optimizer.scale_loss(1.0)  # (lossscale warns of gradients of an unscaled loss)
    for step in range(6):
        if "lr_steps" in settings:
            inner.learning_rate = settings["lr_steps"][step]
        if "wd_steps" in settings:
            inner.weight_decay = settings["wd_steps"][step]
        grads = [np.asarray(4.0 * rng.normal(size=s), np.float32) for s in FOLD_SHAPES]
        if zero_grads:
            grads = [np.zeros_like(g) for g in grads]
        if step == 2:
            grads[1][-1] = np.inf  # the whole step is skipped, decay included
        optimizer.apply([to_tensor(g, dtype) for g in grads], variables)
    values = [v.value.detach() for v in variables]
    return [v.float() if v.dtype == torch.bfloat16 else v for v in values]


def keras_fold_run(case, zero_grads):
    return fold_run(
        keras,
        case,
        lambda g, dtype: keras.ops.cast(keras.ops.convert_to_tensor(g), dtype),
        lambda v, dtype, name: keras.Variable(v, dtype=dtype, name=name),
        zero_grads,
    )


def lossscale_fold_run(case, zero_grads):
    return fold_run(
        ls,
        case,
        lambda g, dtype: torch.from_numpy(g).to(getattr(torch, dtype)),
        lambda v, dtype, name: ls.Variable(
            torch.from_numpy(v).to(getattr(torch, dtype)), name=name
        ),
        zero_grads,
    )


class KernelSpy:
    """Records which fused Adam kernel each step's groups ran (`_fused_adam_` or `_fused_adamw_`)."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("_fused_adam_", "_fused_adamw_"):
            original = getattr(torch, name)
            monkeypatch.setattr(torch, name, self._spy(name, original))

    def _spy(self, name, original):
        def spy(*args, **kwargs):
            self.calls.append((name, kwargs["weight_decay"]))
            return original(*args, **kwargs)

        return spy


# Keras 3.x on torch cannot exclude every variable (its multi-tensor decay is
# given an empty list); lossscale's run of that case is held to the device path.
@pytest.mark.parametrize("case", sorted(set(FOLD_CASES) - {"all_excluded"}))
def test_the_decay_folded_or_not_is_keras_on_torch_bit_for_bit(monkeypatch, case):
    spy = KernelSpy(monkeypatch)
    got = lossscale_fold_run(case, zero_grads=True)
    want = keras_fold_run(case, zero_grads=True)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), case
    folded = [wd for name, wd in spy.calls if name == "_fused_adamw_"]
    plain = [wd for name, wd in spy.calls if name == "_fused_adam_"]
    assert all(wd == 0.0 for wd in plain)
    if case in ("float32", "schedule", "weight_decay_changed"):
        assert len(folded) == 6 and not plain, spy.calls  # every step folded, at every rate
    elif case == "lr_in_place":  # folded at each rate, but the last, 0: nothing to fold
        assert len(folded) == 5 and len(plain) == 1 and spy.calls[-1][0] == "_fused_adam_"
    elif case == "excluded":  # the decayed ones folded, the excluded ones plain
        assert len(folded) == len(plain) == 6, spy.calls
    elif case == "rate_zero":
        assert plain and not folded, spy.calls  # alpha is 0: nothing to fold
    elif case == "inexact":
        assert folded and plain, spy.calls  # both sides of the exactness check
    elif case == "float64":  # the step size on the device, the decay its own pass
        assert plain and not folded, spy.calls
    else:  # half precision takes the foreach rule, after a decay of its own
        assert not spy.calls


@pytest.mark.parametrize("case", sorted(FOLD_CASES))
def test_the_host_path_equals_the_device_path_bit_for_bit(monkeypatch, case):
    # Real gradients: the step size computed on the host and the decay
    # folded are the device path's arithmetic, bit for bit.
    from lossscale.backends.torch import multi

    spy = KernelSpy(monkeypatch)
    host_run = lossscale_fold_run(case, zero_grads=False)
    if case == "all_excluded":
        assert {name for name, _ in spy.calls} == {"_fused_adam_"}
    monkeypatch.setattr(multi, "HOST_READABLE", frozenset())
    spy.calls.clear()
    device_run = lossscale_fold_run(case, zero_grads=False)
    assert "_fused_adamw_" not in {name for name, _ in spy.calls}
    for a, b in zip(host_run, device_run):
        assert torch.equal(bits(a), bits(b)), case


def test_a_learning_rate_given_as_a_number_is_not_folded(monkeypatch):
    # A callable rate may hand a Python number: Keras's factor is then a
    # number too, and the decay stays a kernel of its own.
    spy = KernelSpy(monkeypatch)
    w = torch.ones(8)
    opt = ls.optimizers.AdamW(lambda: 0.01, weight_decay=0.1)
    opt.apply([torch.ones(8)], [w])
    assert spy.calls == [("_fused_adam_", 0.0)]


@pytest.mark.parametrize("kind", ["inf", "nan", "-inf"])
@pytest.mark.parametrize("position", ["first", "last", "random"])
def test_a_skipped_step_on_the_folded_path_changes_nothing(monkeypatch, kind, position):
    spy = KernelSpy(monkeypatch)
    rng = np.random.default_rng(31)
    params = [torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in FOLD_SHAPES]
    opt = ls.LossScaleOptimizer(ls.optimizers.AdamW(0.05, weight_decay=0.1), initial_scale=8.0)
    opt.scale_loss(1.0)
    grads = [torch.tensor(8 * rng.normal(size=s), dtype=torch.float32) for s in FOLD_SHAPES]
    opt.apply(grads, params)
    params[0].view(-1)[:2] = torch.tensor([-0.0, 0.0])  # a decay would keep their signs
    inner = opt.inner_optimizer.variables  # (the loss scale itself backs off)
    state = [p.clone() for p in params] + [v.value.clone() for v in inner]
    for which in range(len(FOLD_SHAPES)):
        grads = [torch.tensor(8 * rng.normal(size=s), dtype=torch.float32) for s in FOLD_SHAPES]
        flat = grads[which].view(-1)
        at = {"first": 0, "last": flat.numel() - 1}.get(position)
        at = int(rng.integers(flat.numel())) if at is None else at
        flat[at] = float(kind)
        opt.apply(grads, params)
        for b, a in zip(state, params + [v.value for v in inner]):
            assert torch.equal(bits(b), bits(a)), (which, position)
    assert {name for name, _ in spy.calls} == {"_fused_adamw_"}


def test_folded_rate_on_each_side_of_its_conditions(monkeypatch):
    from lossscale.backends.torch import multi

    lr = torch.tensor(0.05)
    factor = float(torch_adamw.decay_factor(0.1, lr))
    rate = torch_adamw.folded_rate(0.1, lr, 0.0123, {})
    assert rate is not None and np.float32(1.0 - 0.0123 * rate) == np.float32(factor)
    assert torch_adamw.folded_rate(0.1, lr, None, {}) is None  # the step size on the device
    assert torch_adamw.folded_rate(0.1, lr, 0.0, {}) is None  # a rate of 0
    assert torch_adamw.folded_rate(0.1, 0.05, 0.0123, {}) is None  # a Python number
    assert torch_adamw.folded_rate(0.1, lr.double(), 0.0123, {}) is None
    # Inexact: the factor's last place (about 0.33) finer than the rate can set.
    inexact = torch.tensor(0.43241938948631287)
    assert torch_adamw.folded_rate(1.538176028484857, inexact, 0.021039754152297974, {}) is None
    monkeypatch.setattr(multi, "HOST_READABLE", frozenset())
    assert torch_adamw.folded_rate(0.1, lr, 0.0123, {}) is None
