"""Two-process torch.distributed scenarios for tests/test_distributed.py.

Run as `python -m tests.workers.distributed_worker SCENARIO[,SCENARIO...] OUT_DIR PORT`;
spawns two gloo ranks on 127.0.0.1, which run the scenarios one after the
other in one process group (starting the ranks costs more than most
scenarios), and writes `OUT_DIR/SCENARIO_rank{r}.npz` for each.
"""

import sys

import numpy as np
import torch
import torch.distributed as dist

import lossscale as ls

SHAPES = [(5, 3), (3,), (3, 2), (2,)]
STEPS = 6
# (step, parameter index, value): every injection lands in rank 1's shard.
INJECTIONS = [(2, 3, np.inf), (4, 2, np.nan)]


# The statistics policy's scenario: rank 1's gradients 4x larger, so that
# at a scale of 2**10 its peak leaves no room to grow and rank 0's does.
STATISTICS = dict(growth_policy="statistics", diagnostics_every=1)


def gradient_sequence(boost=1.0):
    rng = np.random.default_rng(1)
    steps = [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(STEPS)]
    for grads in steps:
        grads[2] *= np.float32(boost)
        grads[3] *= np.float32(boost)
    for step, index, value in INJECTIONS:
        steps[step][index].flat[0] = value
    return steps


def initial_parameters():
    rng = np.random.default_rng(0)
    return [torch.from_numpy(rng.normal(size=s).astype(np.float32)) for s in SHAPES]


def sharded(rank, singleton_groups, settings=None, boost=1.0):
    """ZeRO-style: each rank updates its own half of the parameters, then shares them."""
    params = initial_parameters()
    own = [2 * rank, 2 * rank + 1]
    groups = [dist.new_group([0]), dist.new_group([1])]
    group = groups[rank] if singleton_groups else None
    opt = ls.LossScaleOptimizer(
        ls.optimizers.Adam(0.01),
        initial_scale=2.0**10,
        dynamic_growth_steps=2,
        process_group=group,
        **(settings or {}),
    )
    scales = []
    for grads in gradient_sequence(boost):
        scale = np.float32(opt.scale_loss(1.0) if not opt.built else float(opt.dynamic_scale))
        opt.apply([torch.from_numpy(grads[i] * scale) for i in own], [params[i] for i in own])
        for i, p in enumerate(params):
            dist.broadcast(p, src=i // 2)
        scales.append(float(opt.dynamic_scale))
    return {
        "scales": np.array(scales),
        "iterations": int(opt.iterations),
        **{f"param{i}": p.numpy() for i, p in enumerate(params)},
    }


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def data():
    rng = np.random.default_rng(2)
    return (
        torch.from_numpy(rng.normal(size=(16, 4)).astype(np.float32)),
        torch.from_numpy(rng.normal(size=(16, 1)).astype(np.float32)),
    )


def train(model, x, y, poison_step=3):
    """The training loop shared by the DDP ranks and the single-process reference."""
    params = list(model.parameters())
    opt = ls.LossScaleOptimizer(
        ls.optimizers.Adam(0.01), initial_scale=2.0**8, dynamic_growth_steps=3
    )
    scales = []
    for step in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == poison_step:
            loss = loss * float("inf")
        opt.scale_loss(loss).backward()
        opt.apply([p.grad for p in params], params)
        model.zero_grad()
        scales.append(float(opt.dynamic_scale))
    return {
        "scales": np.array(scales),
        "iterations": int(opt.iterations),
        **{f"param{i}": p.detach().numpy().copy() for i, p in enumerate(params)},
    }


def ddp(rank):
    x, y = data()
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    half = slice(8 * rank, 8 * rank + 8)
    return train(model, x[half], y[half])


def collectives(rank):
    """The torch backend's `all_max` and `all_true` over the two ranks, NaN placed by rank."""
    from lossscale.backends import get_ops

    ops = get_ops("torch")
    nan = float("nan")
    mine = [[nan, 1.0, 5.0, -2.0], [5.0, 1.0, nan, -3.0]][rank]
    return {
        "max": ops.all_max(torch.tensor(mine)).numpy(),
        "max_scalar": ops.all_max(torch.tensor([nan, 3.0][rank])).numpy(),
        "max_int": ops.all_max(torch.tensor([4, 9][rank], dtype=torch.int32)).numpy(),
        "all_true": np.array(
            [bool(ops.all_true(torch.tensor(flag))) for flag in ([True, False][rank], True)]
        ),
    }


def agreement(rank):
    """`agreement_every=2`: rank 1's state changed behind the optimizer's back after step 0.

    Each front end steps twice on both ranks; the check after the second
    step must raise `LossScaleError` on both, naming what differs.
    """
    from lossscale.mixed_precision import LossScaleError

    torch.manual_seed(0)
    out = {}

    def steps(step, change):
        messages = []
        for k in range(2):
            try:
                step()
                messages.append("")
            except LossScaleError as error:
                messages.append(str(error))
            if k == 0 and rank == 1:
                change()
        return np.array(messages)

    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.1), agreement_every=2)

    def apply():
        scale = float(opt.dynamic_scale)
        opt.scale_loss(torch.tensor(1.0))
        opt.apply([torch.randn(s) * scale for s in SHAPES], params)

    out["loss_scale_optimizer"] = steps(apply, lambda: opt.dynamic_scale.value.fill_(2.0**10))

    model = torch.nn.Linear(8, 4)
    torch_sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    agreeing = ls.torch.GradScaler("cpu", agreement_every=2)
    ours = ls.torch.Optimizer(model.parameters(), ls.optimizers.SGD(0.1), agreement_every=2)
    for name, optimizer, scaler, change in (
        # A scale set on one rank only; a learning rate moved on one rank only.
        ("grad_scaler", torch_sgd, agreeing, lambda: agreeing.update(2.0**7)),
        (
            "torch_optimizer",
            ours,
            ls.torch.GradScaler("cpu"),
            lambda: ours.param_groups[0].update(lr=0.05),
        ),
    ):

        def train_step(optimizer=optimizer, scaler=scaler):
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(16, 8)).square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()

        out[name] = steps(train_step, change)
    return out


SCENARIOS = {
    "sharded": lambda rank: sharded(rank, singleton_groups=False),
    "sharded_statistics": lambda rank: sharded(
        rank, singleton_groups=False, settings=STATISTICS, boost=4.0
    ),
    "sharded_without_agreement": lambda rank: sharded(rank, singleton_groups=True),
    "ddp": ddp,
    "collectives": collectives,
    "agreement": agreement,
}


def run(rank, scenarios, out_dir, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for scenario in scenarios:
            result = SCENARIOS[scenario](rank)
            np.savez(f"{out_dir}/{scenario}_rank{rank}.npz", **result)
            dist.barrier()  # every rank done with its collectives before the next (or shutdown)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    scenarios, out_dir, port = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
    torch.multiprocessing.spawn(run, args=(scenarios, out_dir, port), nprocs=2)
