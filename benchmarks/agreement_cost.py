"""What `agreement_every=100` costs a step: two gloo ranks, alternating rounds.

Usage: `python benchmarks/agreement_cost.py [ROUNDS] [STEPS]` (default 6 rounds
of 300 steps).

Each of two processes (torch.distributed over gloo, on the CPU) trains the
same small MLP (1,050,634 parameters) with `torch.optim.AdamW(fused=True)`
under `lossscale.torch.GradScaler`: a whole step (forward, backward, step,
update), once without `agreement_every` and once with
`agreement_every=100`, the order alternating from round to round. Rank 0
prints each round's ms per step of both rows and their ratio, then the
median ratio.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lossscale.torch


def run(agreement_every, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = lossscale.torch.GradScaler("cpu", init_scale=2.0**10, agreement_every=agreement_every)
    x, y = torch.randn(32, 512), torch.randint(0, 10, (32,))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    dist.barrier()
    return (time.perf_counter() - start) / steps * 1e3


def worker(rank, rounds, steps):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    ratios = []
    for r in range(rounds):
        rows = (None, 100) if r % 2 == 0 else (100, None)
        ms = {row: run(row, steps) for row in rows}
        ratios.append(ms[100] / ms[None])
        if rank == 0:
            print(
                f"round {r}: off {ms[None]:.3f} ms, every 100 {ms[100]:.3f} ms, "
                f"ratio {ratios[-1]:.4f}",
                flush=True,
            )
    if rank == 0:
        print(f"median ratio {statistics.median(ratios):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    mp.spawn(worker, args=(rounds, steps), nprocs=2)
