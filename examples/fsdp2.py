"""FSDP2 (`fully_shard`) training with LossScaleOptimizer, on CPU or GPUs.

Run with:  torchrun --nproc_per_node=2 examples/fsdp2.py

Each rank holds a shard of every parameter (DTensors), and of the optimizer
state made next to them: Adam's moments are sharded like the parameters.
The model computes in float16 (`MixedPrecisionPolicy`) and keeps float32
shards; the loss is scaled so that float16 gradients do not underflow, and
a step whose gradients overflow on any rank is skipped on every rank.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import lossscale as ls


def main():
    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights and data on every rank
    x = torch.randn(512, 8)
    y = x @ torch.randn(8, 1) / 3
    mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    params = list(model.parameters())
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-2), dynamic_growth_steps=50)
    for step in range(200):
        loss = torch.nn.functional.mse_loss(model(x[mine]).float(), y[mine])
        opt.scale_loss(loss).backward()
        grads = [p.grad for p in params]
        if step == 100 and rank == world - 1:
            grads[0].to_local().view(-1)[0] = float("inf")  # an overflow in one shard
        opt.apply(grads, params)
        model.zero_grad()
    full = [p.full_tensor() for p in params]  # gathered from the shards
    if rank == 0:
        print(
            f"ranks {world}  loss {loss.item():.4g}  loss scale {float(opt.dynamic_scale):g}  "
            f"steps {int(opt.iterations)}  parameters {sum(p.numel() for p in full)}  "
            f"pid {os.getpid()}"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
