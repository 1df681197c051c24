"""torch_multi over gradients of several dtypes: one group's overflow skips the whole step.

`unscale_checked`, `finite_flags` and `all_finite` run one check per (device,
dtype) group and combine the groups' flags; an inf or NaN in exactly one
group (each group in turn, at the first, last or a random element of a
tensor on either side of the packing threshold `PACK_BELOW`) must flag the
whole list. `LossScaleOptimizer` over variables of those dtypes then skips
the step: every variable bit for bit as it was, the scale halved.
"""

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends.torch import multi as torch_multi
from lossscale.optimizers import SGD, Adam, RMSprop

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# One tensor, one element-wise dtype kernel; 4097: past 4096; 70000: past
# `PACK_BELOW` (65,536), reduced on its own instead of packed.
SIZES = [1, 4097, 70000]
POSITIONS = ["first", "last", "random"]
BAD_VALUES = [np.inf, -np.inf, np.nan]
SCALE = 2.0**10


def test_the_sizes_lie_on_both_sides_of_the_packing_threshold():
    assert min(SIZES) < torch_multi.PACK_BELOW < max(SIZES)


def _layout(dtypes):
    """`(size, dtype)` per tensor, the dtypes interleaved: each group's indices are apart."""
    return [(n, d) for n in SIZES for d in dtypes]


def _gradients(dtypes, seed, scale=SCALE):
    rng = np.random.default_rng(seed)
    return [torch.tensor(rng.normal(size=n) * scale, dtype=d) for n, d in _layout(dtypes)]


def _element(position, size, seed):
    if position == "first":
        return 0
    if position == "last":
        return size - 1
    return int(np.random.default_rng(seed).integers(size))


def _inject(grads, dtypes, bad_dtype, size, position, seed):
    """Writes one bad value into the `(size, bad_dtype)` tensor; returns its index."""
    index = _layout(dtypes).index((size, bad_dtype))
    element = _element(position, size, seed)
    grads[index].view(-1)[element] = BAD_VALUES[seed % len(BAD_VALUES)]
    return index


def _bits(x):
    return x.detach().reshape(-1).view(torch.uint8)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# Every combination of a few dtypes, the float32 + float64 pair alone among them.
DTYPE_SETS = {
    "f32_f64": [torch.float32, torch.float64],
    "f64_f16": [torch.float64, torch.float16],
    "all": DTYPES,
}
CASES = [
    pytest.param(
        dtypes, bad_dtype, size, position, id=f"{key}-{str(bad_dtype)[6:]}-{size}-{position}"
    )
    for key, dtypes in DTYPE_SETS.items()
    for bad_dtype in dtypes
    for size in SIZES
    for position in POSITIONS
]


@pytest.mark.parametrize("dtypes,bad_dtype,size,position", CASES)
def test_one_bad_group_flags_all_three_checks(dtypes, bad_dtype, size, position):
    seed = len(dtypes) * 100 + DTYPES.index(bad_dtype) * 10 + SIZES.index(size)
    seed = seed * 3 + POSITIONS.index(position)
    grads = _gradients(dtypes, seed)
    _inject(grads, dtypes, bad_dtype, size, position, seed)
    clean = _gradients(dtypes, seed)  # the same values, without the bad one

    # all_finite and finite_flags never write what they check.
    before = [g.clone() for g in grads]
    assert bool(torch_multi.all_finite(grads)) is False
    assert bool(torch_multi.all_finite(clean)) is True
    finite, skip = torch_multi.finite_flags([g.clone() for g in grads])
    assert bool(finite) is False
    assert skip.dtype == torch.float32 and float(skip) == 1.0
    finite, skip = torch_multi.finite_flags([g.clone() for g in clean])
    assert bool(finite) is True and float(skip) == 0.0
    assert all(_same_bits(b, g) for b, g in zip(before, grads))

    # unscale_checked: the one-pass AMP kernel (a power-of-two CPU scale, the
    # gradients handed over), and unscale-then-check (copies; a scale whose
    # inverse is not exact).
    for scale, in_place in [(SCALE, True), (SCALE, False), (3.0, True)]:
        for given, expected in [(grads, False), (clean, True)]:
            given = [g.clone() for g in given]
            unscaled, finite, skip = torch_multi.unscale_checked(
                given, torch.tensor(scale), in_place=in_place
            )
            assert bool(finite) is expected, (scale, in_place)
            assert float(skip) == (0.0 if expected else 1.0), (scale, in_place)
            if expected:
                for g, u in zip(clean, unscaled):
                    wide = g.float() if g.dtype.itemsize < 4 else g
                    assert _same_bits(u, wide / torch.tensor(scale, dtype=wide.dtype))


RULES = {
    "sgd_momentum": lambda: SGD(0.1, momentum=0.9),  # torch's fused SGD kernel
    "adam": lambda: Adam(0.01),  # torch's fused Adam kernel
    "rmsprop": lambda: RMSprop(0.01),  # a foreach kernel
}


# `apply` unscales the gradients in place (the one-pass AMP check),
# `stateless_apply` into copies (unscale, then `finite_flags`).
@pytest.mark.parametrize(
    "rule,mode", [("adam", "apply"), ("sgd_momentum", "stateless_apply"), ("rmsprop", "apply")]
)
@pytest.mark.parametrize("bad_dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("size", SIZES)
def test_loss_scale_optimizer_skips_a_step_with_one_bad_group(mode, rule, bad_dtype, size):
    seed = DTYPES.index(bad_dtype) * 10 + SIZES.index(size)
    rng = np.random.default_rng(seed)
    variables = [
        ls.Variable(torch.tensor(rng.normal(size=n), dtype=d), name=f"v{i}")
        for i, (n, d) in enumerate(_layout(DTYPES))
    ]
    opt = ls.LossScaleOptimizer(RULES[rule](), initial_scale=SCALE, dynamic_growth_steps=1000)
    opt.scale_loss(1.0)

    def step(grads):
        if mode == "apply":
            opt.apply(grads, variables)
            return
        new_values, new_opt = opt.stateless_apply(
            [v.value for v in opt.variables], grads, [v.value for v in variables]
        )
        for v, x in zip([*variables, *opt.variables], [*new_values, *new_opt]):
            v.assign(x)

    opt.build(variables)
    step(_gradients(DTYPES, seed + 1))  # a finite step first: slots that are not zero
    assert float(opt.dynamic_scale) == SCALE and int(opt.iterations) == 1
    for k, position in enumerate(POSITIONS):
        scale = float(opt.dynamic_scale)
        grads = _gradients(DTYPES, seed + 2 + k, scale)
        _inject(grads, DTYPES, bad_dtype, size, position, seed + k)
        # The model's variables and every variable of the rule (slots, step count).
        watched = [*variables, *opt.inner_optimizer.variables]
        before = [v.value.clone() for v in watched]
        step(grads)
        after = [v.value for v in watched]
        assert all(_same_bits(b, a) for b, a in zip(before, after)), position
        assert float(opt.dynamic_scale) == scale / 2, position
        assert int(opt.iterations) == 1
    # The same variables move on a finite step: the checks above could see a change.
    before = [v.value.clone() for v in variables]
    step(_gradients(DTYPES, seed + 9, float(opt.dynamic_scale)))
    assert int(opt.iterations) == 2
    moved = [not _same_bits(b, v.value) for b, v in zip(before, variables)]
    # (float32 and float64 ones: Adam's bias correction rounds to 0 in
    # bfloat16, as in Keras, and a float16 element may round back to itself)
    assert all(m for m, (_, d) in zip(moved, _layout(DTYPES)) if d.itemsize >= 4)
