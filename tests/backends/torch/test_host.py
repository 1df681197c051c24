"""backends/torch/host.py: Adam's step size on the host equals the device's, bit for bit."""

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends.torch import fused as torch_fused
from lossscale.backends.torch import host, plans
from lossscale.optimizers import Adam

BETAS = [(0.9, 0.999), (0.95, 0.98), (0.5, 0.9999999), (0.87, 0.99)]
BETAS += [tuple(float(b) for b in np.random.default_rng(seed).uniform(0, 1, 2)) for seed in (1, 2)]


def steps_to_check(seed):
    """The first steps, random ones up to 10**7, and both sides of 2**24."""
    rng = np.random.default_rng(seed)
    random = rng.integers(0, 10**7, 1500).tolist()
    return list(range(0, 1500)) + random + [2**24 - 2, 2**24 - 1, 2**24, 2**24 + 1, 10**7]


@pytest.mark.parametrize("betas", BETAS, ids=str)
def test_powf_is_torch_pow_of_a_pair(betas):
    # The device path raises the pair (beta_1, beta_2) to the float32 step.
    pair = torch.tensor(betas, dtype=torch.float32)
    for step in steps_to_check(seed=len(str(betas))):
        t = host.float32(float(step + 1))
        want = torch.pow(pair, torch.tensor(t)).tolist()
        assert [host._powf(betas[0], t), host._powf(betas[1], t)] == want, step


def device_step_size(opt, group, lr):
    hyper = opt._hyper_type(*(getattr(opt, k) for k in opt._hyper_type._fields))
    return torch_fused._adam_step_size(hyper, group, lr, opt.iterations)


@pytest.mark.parametrize("betas", BETAS, ids=str)
def test_the_step_size_is_the_device_ones_bit_for_bit(betas):
    rng = np.random.default_rng(3)
    params = [ls.Variable(torch.ones(3))]
    opt = Adam(0.003, beta_1=betas[0], beta_2=betas[1])
    opt.build(params)
    group = plans.plan(params, {}, {}).groups[0]
    for step in steps_to_check(seed=4)[::7]:
        opt.iterations.assign(step)
        lr = torch.tensor(np.float32(10.0 ** rng.uniform(-8, 1)))
        got = host.adam_step_size(*betas, opt.iterations, lr, group, {})
        want = device_step_size(opt, group, lr)
        assert got is not None and np.float32(got).view(np.uint32) == want.numpy().view(np.uint32)


@pytest.mark.parametrize("betas", BETAS[:3], ids=str)
def test_consecutive_steps_across_the_cached_blocks_are_the_device_ones(betas):
    # One cache, as a run keeps it: steps read from blocks of ROOT_BLOCK
    # computed at once, across block ends, where float32 steps start to
    # round, and where 1 - beta_2**t has reached 1 (beta_2 = 0.98).
    params = [ls.Variable(torch.ones(3))]
    opt = Adam(0.003, beta_1=betas[0], beta_2=betas[1])
    opt.build(params)
    group = plans.plan(params, {}, {}).groups[0]
    lr, cache = torch.tensor(np.float32(0.003)), {}
    spans = (range(0, 2 * host.ROOT_BLOCK + 9), range(2**24 - 300, 2**24 + 300, 3))
    for step in (s for span in spans for s in span):
        opt.iterations.assign(step)
        got = host.adam_step_size(*betas, opt.iterations, lr, group, cache)
        want = device_step_size(opt, group, lr)
        assert got is not None and np.float32(got).view(np.uint32) == want.numpy().view(np.uint32)


def test_a_python_int_count_and_a_learning_rate_read_once():
    from tests.torch_cases import count_ops

    params = [ls.Variable(torch.ones(3))]
    group = plans.plan(params, {}, {}).groups[0]
    lr, cache = torch.tensor(0.01), {}
    host.adam_step_size(0.9, 0.999, 5, lr, group, cache)
    with count_ops() as seen:
        got = host.adam_step_size(0.9, 0.999, 5, lr, group, cache)
    assert seen == []  # nothing dispatched: the rate kept, the count a number
    lr.mul_(0.5)  # written in place: read again
    with count_ops() as seen:
        halved = host.adam_step_size(0.9, 0.999, 5, lr, group, cache)
    assert seen == ["aten._local_scalar_dense.default"] and halved == got / 2


@pytest.mark.parametrize(
    "case", ["float64", "float16", "not_host_readable", "powf_disagrees", "bias_zero", "overflow"]
)
def test_where_the_step_size_stays_on_the_device(monkeypatch, case):
    dtype = {"float64": torch.float64, "float16": torch.float16}.get(case, torch.float32)
    params = [ls.Variable(torch.ones(3, dtype=dtype))]
    group = plans.plan(params, {}, {}).groups[0]
    lr, betas = torch.tensor(0.01, dtype=dtype), (0.9, 0.999)
    if case == "not_host_readable":
        monkeypatch.setattr(host.multi, "HOST_READABLE", frozenset())
    elif case == "powf_disagrees":
        betas = (0.8125, 0.999)  # a pair not checked yet (the check is cached per pair)
        monkeypatch.setattr(host, "_POWF", lambda b, t: np.nextafter(np.float32(b), 0) ** t)
    elif case == "bias_zero":
        betas = (1 - 1e-9, 0.999)  # beta_1 rounds to 1.0 in float32
    elif case == "overflow":
        lr, betas = torch.tensor(3e38), (0.9, 0.0)  # alpha = lr / 0.1 at the first step
    assert host.adam_step_size(*betas, 0, lr, group, {}) is None
    host._powf_agrees.cache_clear()


def test_a_disagreeing_powf_leaves_adam_on_the_device_bit_for_bit(monkeypatch):
    def run():
        w = torch.linspace(-1, 1, 300 * 250).reshape(300, 250)
        opt = Adam(0.01, beta_1=0.8, beta_2=0.995)
        for step in range(4):
            opt.apply([torch.sin(w * (step + 1))], [w])
        return w

    want = run()
    monkeypatch.setattr(host, "_POWF", lambda b, t: 0.5)
    host._powf_agrees.cache_clear()
    assert not host._powf_agrees(0.8, 0.995)
    assert torch.equal(run(), want)
    host._powf_agrees.cache_clear()


def test_float32_rounds_to_nearest_and_overflows_to_infinity():
    assert host.float32(0.1) == float(np.float32(0.1))
    assert host.float32(1 + 2.0**-24) == 1.0  # a tie: to even
    assert host.float32(1e39) == np.inf and host.float32(-1e39) == -np.inf
    largest = float(np.finfo(np.float32).max)
    assert host.float32(largest * (1 + 2.0**-25)) == largest
