"""lossscale.torch.GradScaler with several optimizers: an overflow in any one backs the scale off.

`scaler.step(first); scaler.step(second); scaler.update()`, with an inf or
NaN in the first optimizer's gradients only, or in the second's only (at the
first, last or a random element): the optimizer whose gradients overflowed
skips its step, the other steps, and the update backs the scale off,
`last_step_skipped` True. Torch's own `torch.amp.GradScaler` gives the same
scales, the same steps and the same weights bit for bit, for fused and
non-fused optimizers.
"""

import pytest
import torch

import lossscale.torch as lt
from tests import grad_scaler_cases as cases

STEPS = 10
# The poisoned steps: `(whose gradients, where in a gradient, the value)`.
POISONED = {
    2: ("first", "first", float("inf")),
    4: ("second", "last", float("nan")),
    6: ("first", "random", float("-inf")),
    8: ("second", "random", float("inf")),
}
KINDS = [("fused", "fused"), ("foreach", "foreach"), ("fused", "foreach"), ("foreach", "fused")]


def make_optimizers(model, kinds):
    """AdamW over the head, SGD with momentum over the rest: `(first, second)`."""
    head = list(model.head.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    first = torch.optim.AdamW(
        head, lr=3e-3, fused=kinds[0] == "fused", foreach=None if kinds[0] == "fused" else True
    )
    second = torch.optim.SGD(
        rest,
        lr=0.1,
        momentum=0.9,
        fused=kinds[1] == "fused",
        foreach=None if kinds[1] == "fused" else True,
    )
    return first, second


def poison(optimizer, position, value, seed):
    """Writes `value` into one gradient of `optimizer`: its first, last or a random element."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    g = torch.Generator().manual_seed(seed)
    grad = grads[int(torch.randint(len(grads), (), generator=g))].view(-1)
    element = {
        "first": 0,
        "last": grad.numel() - 1,
        "random": int(torch.randint(grad.numel(), (), generator=g)),
    }[position]
    grad[element] = value


def run(scaler, kinds, poisoned=POISONED):
    model = cases.TinyTransformer()
    optimizers = make_optimizers(model, kinds)
    tokens, targets = cases.batch()
    scales, skipped, steps = [], [], []
    for step in range(STEPS):
        loss = cases.loss_of(model, tokens, targets)
        model.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if step in poisoned:
            which, position, value = poisoned[step]
            poison(optimizers[0 if which == "first" else 1], position, value, seed=step)
        before = [[p.detach().clone() for p in opt.param_groups[0]["params"]] for opt in optimizers]
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(getattr(scaler, "last_step_skipped", None))
        steps.append(
            tuple(
                not cases.same_weights(b, [p.detach() for p in opt.param_groups[0]["params"]])
                for b, opt in zip(before, optimizers)
            )
        )
    return {
        "scales": scales,
        "skipped": skipped,
        "moved": steps,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def scalers(**extras):
    settings = {"init_scale": 2.0**10, "growth_interval": 2}
    return torch.amp.GradScaler("cpu", **settings), lt.GradScaler("cpu", **settings, **extras)


@pytest.mark.parametrize("extras", [{}, {"telemetry": True}], ids=["plain", "telemetry"])
@pytest.mark.parametrize("kinds", KINDS, ids="-".join)
def test_an_overflow_in_either_optimizer_backs_off_as_torch_does(kinds, extras):
    theirs, ours = scalers(**extras)
    a = run(theirs, kinds)
    b = run(ours, kinds)

    assert b["scales"] == a["scales"]
    assert b["moved"] == a["moved"]
    assert cases.same_weights(b["params"], a["params"])
    for step, (which, _, _) in POISONED.items():
        # The scale backs off, whichever optimizer overflowed...
        assert b["scales"][step] == b["scales"][step - 1] / 2, (step, which)
        assert b["skipped"][step] is True, (step, which)
        # ...the one that overflowed skipped its step, the other took its own.
        assert b["moved"][step] == ((False, True) if which == "first" else (True, False))
    # Every step but the poisoned ones finite: applied by both, not skipped.
    for step in set(range(STEPS)) - set(POISONED):
        assert b["skipped"][step] is False and b["moved"][step] == (True, True), step


@pytest.mark.parametrize("which", ["first", "second"])
def test_the_flag_of_each_optimizer_alone_decides_the_update(which):
    # One poisoned step, at the first update: the scale is halved from the
    # initial one, whichever of the two optimizers held the inf.
    theirs, ours = scalers()
    poisoned = {0: (which, "random", float("inf"))}
    a = run(theirs, ("fused", "foreach"), poisoned)
    b = run(ours, ("fused", "foreach"), poisoned)
    assert a["scales"][0] == b["scales"][0] == 2.0**9
    assert b["skipped"][0] is True and b["skipped"][1:] == [False] * (STEPS - 1)
    assert b["scales"] == a["scales"] and cases.same_weights(b["params"], a["params"])
