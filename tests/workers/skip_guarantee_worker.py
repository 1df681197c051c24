"""Two gloo ranks, one bad gradient value on rank 1 only: every rank skips (SPEC section 5).

Run as `python -m tests.workers.skip_guarantee_worker OUT_DIR PORT` for
tests/test_skip_guarantee_distributed.py. Parameters of sizes on both sides
of the backends' thresholds, split between the ranks in two ways:

- `sharded`: ZeRO-style, each rank updates its own parameters with
  `LossScaleOptimizer` (the ranks agree through `torch.distributed`);
- `fsdp2_*`: `fully_shard`, every parameter a DTensor split along its
  length, with `LossScaleOptimizer`, `lossscale.torch.Optimizer` +
  `lossscale.torch.GradScaler`, and `torch.optim.Adam` + that GradScaler.

After an applied step, each case puts one NaN, +inf or -inf in rank 1's
part of one gradient (its first, last or a random element). Each rank
writes whether its parameters and optimizer state stayed bitwise as they
were after every such step, and its scales.
"""

import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

import lossscale as ls
import lossscale.torch as lt

SIZES = (4095, 4097, 65537, 262145, 1_048_579)
VALUES = (float("nan"), float("inf"), float("-inf"))
INITIAL_SCALE = 2.0**10


def cases(local_sizes):
    """`(parameter index, position in rank 1's part, value)`: each parameter, three positions."""
    rng = np.random.default_rng(3)
    out = []
    for i, n in enumerate(local_sizes):
        for k, position in enumerate((0, n - 1, int(rng.integers(n)))):
            out.append((i, position, VALUES[(i + k) % 3]))
    return out


def coefficients():
    rng = np.random.default_rng(1)
    return [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in SIZES]


def make_module():
    rng = np.random.default_rng(0)
    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList(
        torch.nn.Parameter(torch.from_numpy(rng.standard_normal(n).astype(np.float32)))
        for n in SIZES
    )
    return module


def local(t):
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).numpy().copy()


def bits(a):
    return a.view(np.uint32) if a.dtype == np.float32 else a


def snapshot(params, state_tensors):
    return [bits(local(t)) for t in list(params) + list(state_tensors)]


class Wrapper:
    """`LossScaleOptimizer(Adam)` over `params` (agreeing across ranks)."""

    def __init__(self, params):
        self.params = list(params)
        self.opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), initial_scale=INITIAL_SCALE)

    def backward(self, loss):
        self.opt.scale_loss(loss).backward()

    def step(self, poison):
        grads = [p.grad for p in self.params]
        poison(grads)
        self.opt.apply(grads, self.params)
        for p in self.params:
            p.grad = None

    def state(self):
        return [ls.backends.unwrap(v.value) for v in self.opt.inner_optimizer.variables]

    def scale(self):
        return float(self.opt.dynamic_scale)


class Scaled:
    """A torch optimizer stepped by `lossscale.torch.GradScaler`."""

    def __init__(self, params, ours):
        self.params = list(params)
        if ours:
            self.opt = lt.Optimizer(self.params, ls.optimizers.Adam(1e-3))
        else:
            self.opt = torch.optim.Adam(self.params, lr=1e-3)
        self.scaler = lt.GradScaler("cpu", init_scale=INITIAL_SCALE)

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self, poison):
        poison([p.grad for p in self.params])
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()

    def state(self):
        return [t for s in self.opt.state_dict()["state"].values() for t in s.values()]

    def scale(self):
        return self.scaler.get_scale()


def run_cases(rank, runner, coeffs, rank1_sizes):
    """An applied step, then every case; `(unchanged flags, scales)` on this rank.

    `rank1_sizes`: the sizes of rank 1's parts of its gradients, which the
    cases index (every rank takes as many steps).
    """

    def loss():
        return sum((p * c).sum() for p, c in zip(runner.params, coeffs))

    runner.backward(loss())
    runner.step(lambda grads: None)
    before = snapshot(runner.params, runner.state())
    flags, scales = [], [runner.scale()]
    for i, position, value in cases(rank1_sizes):

        def poison(grads, i=i, position=position, value=value):
            if rank == 1:
                g = grads[i]
                (g.to_local() if hasattr(g, "to_local") else g).view(-1)[position] = value

        runner.backward(loss())
        runner.step(poison)
        after = snapshot(runner.params, runner.state())
        flags.append(all(np.array_equal(a, b) for a, b in zip(after, before)))
        scales.append(runner.scale())
    return np.array(flags), np.array(scales)


def sharded(rank):
    """ZeRO-style: rank r owns the parameters at even (r=0) or odd (r=1) indices."""
    own = [i for i in range(len(SIZES)) if i % 2 == rank]
    weights, coeffs = list(make_module().weights), coefficients()
    runner = Wrapper([weights[i] for i in own])
    return run_cases(rank, runner, [coeffs[i] for i in own], SIZES[1::2])


def fsdp2(rank, interface):
    from torch.distributed.fsdp import fully_shard

    module = make_module()
    fully_shard(module)
    params = list(module.weights)
    runner = {
        "wrapper": lambda: Wrapper(params),
        "torch_optimizer": lambda: Scaled(params, ours=True),
        "torch_adam": lambda: Scaled(params, ours=False),
    }[interface]()
    # Plain tensors beside DTensors: FSDP2 treats them as replicated.
    coeffs = [
        torch.distributed.tensor.distribute_tensor(c, p.device_mesh, p.placements)
        for c, p in zip(coefficients(), params)
    ]
    rank1_sizes = [n - (n + 1) // 2 for n in SIZES]  # torch.chunk: the smaller, second part
    return run_cases(rank, runner, coeffs, rank1_sizes)


def run(rank, out_dir, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    warnings.simplefilter("ignore")
    try:
        results = {}
        runs = {"sharded": lambda: sharded(rank)}
        for interface in ("wrapper", "torch_optimizer", "torch_adam"):
            runs[f"fsdp2_{interface}"] = lambda interface=interface: fsdp2(rank, interface)
        for name, run_one in runs.items():
            flags, scales = run_one()
            results[f"{name}/unchanged"] = flags
            results[f"{name}/scales"] = scales
        np.savez(f"{out_dir}/rank{rank}.npz", **results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    out_dir, port = sys.argv[1], int(sys.argv[2])
    torch.multiprocessing.spawn(run, args=(out_dir, port), nprocs=2)
