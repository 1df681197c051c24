"""lossscale.torch.Optimizer under a GradScaler with the rule's own clipping.

A GradScaler hands the optimizer `grad_scale` with the gradients still
scaled. The scale may go into the rule's kernel (divided out as it reads
each gradient) only where nothing reads the gradients before it; with
`clipnorm`, `global_clipnorm` or `clipvalue` set on the rule, the gradients
must be unscaled first, so that the clipping sees the unscaled gradients:
the run then equals, bit for bit, the rule run on gradients unscaled by
hand. Each case makes the clip bind, and checks that clipping the scaled
gradients (the scale folded into the kernel) would give another result.
"""

import numpy as np
import pytest
import torch

import lossscale as ls
import lossscale.torch as lt
from lossscale.backends import get_ops
from lossscale.optimizers import SGD, AdamW, clipping

SHAPES = [(256, 128), (128,), (128, 10), (10,)]
STEPS = 4
SCALE = 2.0**14  # a power of two: unscaling by hand is exact
CLIPS = {"clipnorm": 1.0, "global_clipnorm": 1.0, "clipvalue": 0.25}
RULES = {
    "adamw": lambda **clip: AdamW(1e-2, weight_decay=0.1, **clip),
    "sgd": lambda **clip: SGD(0.1, momentum=0.9, **clip),
}
SCALERS = {"lossscale": lt.GradScaler, "torch": torch.amp.GradScaler}


def make_params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def grads_for(step):
    """Unscaled gradients of a realistic size, larger than every clip of `CLIPS`."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) * 3.0 for s in SHAPES]


def run(rule, grads_of_step, scaler_class=None):
    """`STEPS` steps of `lossscale.torch.Optimizer(rule)`: `(params, rule variables)`.

    With `scaler_class`, each step's gradients are given multiplied by `SCALE`
    and stepped through that GradScaler; else given as they are.
    """
    params = make_params()
    opt = lt.Optimizer(params, rule)
    scaler = None if scaler_class is None else scaler_class("cpu", init_scale=SCALE)
    for step in range(STEPS):
        grads = grads_of_step(step)
        for p, g in zip(params, grads):
            p.grad = g.clone() if scaler is None else g * SCALE
        if scaler is None:
            opt.step()
        else:
            scaler.scale(torch.ones(()))
            scaler.step(opt)
            scaler.update()
            assert scaler.get_scale() == SCALE  # no overflow, no growth: every step taken
    assert int(opt.rules[0].iterations) == STEPS
    return [p.detach().clone() for p in params], [v.value.clone() for v in opt.rules[0].variables]


def clipped_while_scaled(clip, value):
    """What a step would read with the scale folded into the kernel: clip(g * SCALE) / SCALE."""
    ops = get_ops("torch")

    def grads_of_step(step):
        scaled = [g * SCALE for g in grads_for(step)]
        return [g / SCALE for g in clipping.clip_gradients(ops, scaled, **{clip: value})]

    return grads_of_step


def assert_equal_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def test_each_clip_binds_on_the_unscaled_gradients():
    ops = get_ops("torch")
    for step in range(STEPS):
        grads = grads_for(step)
        assert min(float(torch.linalg.vector_norm(g)) for g in grads) > CLIPS["clipnorm"]
        assert float(ops.global_norm(grads)) > CLIPS["global_clipnorm"]
        assert all(float(g.abs().max()) > CLIPS["clipvalue"] for g in grads)


@pytest.mark.parametrize("scaler", sorted(SCALERS))
@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_under_a_grad_scaler_clipping_sees_unscaled_gradients(rule, clip, scaler):
    make = lambda: RULES[rule](**{clip: CLIPS[clip]})  # noqa: E731
    # The rule's plan: its kernel could take the scale, but for the clipping.
    probe = make()
    probe.build([ls.Variable(p.detach().clone()) for p in make_params()])
    plan = probe._step_plan(probe._trainable_variables)
    assert plan.kernel is not None and plan.kernel.takes_grad_scale
    assert not plan.takes_grad_scale

    scaled = run(make(), grads_for, SCALERS[scaler])
    # The same rule, its clipping included, on gradients unscaled by hand.
    expected = run(make(), grads_for)
    assert_equal_bits(scaled[0], expected[0])
    assert_equal_bits(scaled[1], expected[1])
    # The same again as lossscale's own optimizer on lossscale Variables.
    variables, reference = [ls.Variable(p.detach().clone()) for p in make_params()], make()
    for step in range(STEPS):
        reference.apply(grads_for(step), variables)
    assert_equal_bits(scaled[0], [v.value for v in variables])

    # Clipping the scaled gradients (the scale folded into the kernel) would
    # give a different result for every parameter.
    folded = run(RULES[rule](), clipped_while_scaled(clip, CLIPS[clip]))
    for ours, theirs in zip(scaled[0], folded[0]):
        assert not torch.equal(ours, theirs)
        # Not a rounding difference: the clip binds by orders of magnitude.
        assert float((ours - theirs).abs().max()) > 1e-6


@pytest.mark.parametrize("scaler", sorted(SCALERS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_without_clipping_the_scale_goes_into_the_kernel_with_the_same_result(rule, scaler):
    # The control: no clip, the scale folded into the kernel, and the run is
    # the hand-unscaled run bit for bit (so the clipped cases above compare
    # like with like).
    probe = RULES[rule]()
    probe.build([ls.Variable(p.detach().clone()) for p in make_params()])
    assert probe._step_plan(probe._trainable_variables).takes_grad_scale
    scaled = run(RULES[rule](), grads_for, SCALERS[scaler])
    expected = run(RULES[rule](), grads_for)
    assert_equal_bits(scaled[0], expected[0])
    assert_equal_bits(scaled[1], expected[1])
    assert np.isfinite(sum(float(p.sum()) for p in scaled[0]))
