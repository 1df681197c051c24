"""DistributedDataParallel training with LossScaleOptimizer on CPU.

Run with:  torchrun --nproc_per_node=2 examples/torch_ddp.py

Each rank trains on its half of a synthetic regression set; DDP averages the
gradients, and LossScaleOptimizer all-reduces its overflow flag across the
default process group, so every rank skips (and rescales) on the same steps.
"""

import os

import torch
import torch.distributed as dist

import lossscale as ls


def main():
    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights and data on every rank
    x = torch.randn(512, 8)
    y = x @ torch.randn(8, 1) / 3
    mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    )
    params = list(model.parameters())
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-2), dynamic_growth_steps=50)
    for step in range(300):
        loss = torch.nn.functional.mse_loss(model(x[mine]).float(), y[mine])
        if step == 150:
            loss = loss * float("inf")  # an overflow: every rank must skip it
        opt.scale_loss(loss).backward()
        opt.apply([p.grad for p in params], params)
        model.zero_grad()
    # Every rank holds the same weights and the same scale.
    checksum = torch.stack([p.detach().sum() for p in params]).sum()
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.stack([checksum, opt.dynamic_scale.value]))
    assert all(torch.equal(g, gathered[0]) for g in gathered), gathered
    if rank == 0:
        print(
            f"ranks {world}  loss {loss.item():.4g}  loss scale {float(opt.dynamic_scale):g}  "
            f"steps {int(opt.iterations)}  pid {os.getpid()}"
        )
    del model  # DDP's reducer must go before its process group does
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
