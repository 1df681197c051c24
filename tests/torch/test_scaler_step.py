"""torch/scaler_step.py: when `GradScaler.step` steps the optimizer, and when it reads the flag.

torch's fused SGD with momentum cannot skip its first step in its kernel
(it stores `empty_like` momentum buffers: `lossscale.torch.fused_sgd`).
The oracle for a run whose first steps overflow is torch's own scaler on
the same run without those steps, started at the scale they backed off to:
bit for bit, parameters and momentum buffers. The rest of `step` is torch's
(compared in test_grad_scaler.py).
"""

import numpy as np
import pytest
import torch

import lossscale.torch as lt
from tests.torch_cases import no_host_reads

# Both sides of torch's CPU kernels' vector width and of lossscale's packing
# sizes, and a tensor past 1M elements, odd.
SIZES = (1, 7, 8, 9, 64, 4097, 65537, 1_048_579)
SCALE = 2.0**16
SETTINGS = {
    "momentum": dict(momentum=0.9),
    "dampening": dict(momentum=0.9, dampening=0.25, weight_decay=1e-2),
    "nesterov": dict(momentum=0.8, nesterov=True),
}


def _params():
    rng = np.random.default_rng(0)
    return [
        torch.nn.Parameter(torch.from_numpy(rng.uniform(-1, 1, n).astype(np.float32)))
        for n in SIZES
    ]


def _grads(steps, bad_steps, seed):
    """Per step, one gradient per parameter; on `bad_steps` one bad value somewhere."""
    rng = np.random.default_rng(seed)
    runs = []
    for step in range(steps):
        grads = [torch.from_numpy(rng.normal(0, 1e-2, n).astype(np.float32)) for n in SIZES]
        if step in bad_steps:
            tensor = int(rng.integers(len(SIZES)))
            where = [0, SIZES[tensor] - 1, int(rng.integers(SIZES[tensor]))][step % 3]
            grads[tensor][where] = [np.nan, np.inf, -np.inf][int(rng.integers(3))]
        runs.append(grads)
    return runs


def _sgd(params, settings):
    return torch.optim.SGD(params, lr=0.1, fused=True, **SETTINGS[settings])


def _train(scaler, opt, params, runs, unscale_first=False):
    for grads in runs:
        scaler.scale(torch.ones(()))  # creates the scale, as a forward pass does
        scale = scaler.get_scale()
        for p, g in zip(params, grads):
            p.grad = g * scale
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_ then step"])
@pytest.mark.parametrize("overflows", [1, 3])
@pytest.mark.parametrize("settings", list(SETTINGS))
def test_first_steps_that_overflow_leave_fused_sgd_as_if_they_never_ran(
    settings, overflows, unscale_first
):
    runs = _grads(3 + overflows, bad_steps=range(overflows), seed=overflows)
    ours = _params()
    opt = _sgd(ours, settings)
    scaler = lt.GradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
    _train(scaler, opt, ours, runs[:overflows], unscale_first)
    # Nothing was made: torch's kernel would have stored uninitialised buffers.
    assert len(opt.state) == 0
    assert all(torch.equal(p, q) for p, q in zip(ours, _params()))
    assert scaler.get_scale() == SCALE / 2**overflows
    _train(scaler, opt, ours, runs[overflows:], unscale_first)

    theirs = _params()
    twin = _sgd(theirs, settings)
    reference = torch.amp.GradScaler("cpu", init_scale=SCALE / 2**overflows, growth_interval=10**6)
    _train(reference, twin, theirs, runs[overflows:], unscale_first)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], twin.state[q]["momentum_buffer"])
    assert scaler.get_scale() == reference.get_scale()


def test_skipped_first_step_makes_no_state():
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    scaler = lt.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.ones(()))
    for p, g in zip(params, _grads(1, bad_steps=[0], seed=5)[0]):
        p.grad = g
    assert scaler.step(opt) is None
    assert len(opt.state) == 0
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)  # torch's stage error, unchanged
    scaler.update()
    assert scaler.get_scale() == SCALE / 2


def test_torchs_own_scaler_keeps_buffers_that_no_kernel_filled():
    """The flaw `scaler_step` works around (torch 2.13): if this fails, torch fixed it."""
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.ones(()))
    for p, g in zip(params, _grads(1, bad_steps=[0], seed=5)[0]):
        p.grad = g
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == SCALE / 2  # skipped ...
    assert all("momentum_buffer" in opt.state[p] for p in params)  # ... yet buffers were kept


def test_after_the_first_applied_step_fused_sgd_steps_without_host_reads():
    params = _params()
    scaler = lt.GradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
    runs = _grads(4, bad_steps=[2], seed=7)
    opt = _sgd(params, "momentum")
    _train(scaler, opt, params, runs[:1])
    before = [opt.state[p]["momentum_buffer"].clone() for p in params]
    with no_host_reads():  # the flag goes to the kernel as a device tensor
        for grads in runs[1:]:
            scaler.scale(torch.ones(()))
            for p, g in zip(params, grads):
                p.grad = g * SCALE
            scaler.step(opt)
            scaler.update()
    assert not any(torch.equal(b, opt.state[p]["momentum_buffer"]) for b, p in zip(before, params))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),  # no momentum: no buffer
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),  # read anyway
        lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),  # its state starts at zeros
    ],
    ids=["sgd fused", "sgd momentum foreach", "adamw fused"],
)
def test_other_optimizers_step_as_under_torchs_scaler(make):
    runs = _grads(4, bad_steps=[0, 2], seed=11)
    results = []
    for cls in (torch.amp.GradScaler, lt.GradScaler):
        params = _params()
        opt = make(params)
        scaler = cls("cpu", init_scale=SCALE, growth_interval=10**6)
        for grads in runs:
            scaler.scale(torch.ones(()))
            for p, g in zip(params, grads):
                p.grad = g * scaler.get_scale()
            scaler.step(opt)
            scaler.update()
        results.append((params, scaler.get_scale()))
    (theirs, their_scale), (ours, our_scale) = results
    assert our_scale == their_scale == SCALE / 4
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
