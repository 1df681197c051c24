"""Two-rank gloo runs of `GradScaler` for tests/torch/test_grad_scaler_ecosystem.py.

Run as `python -m tests.workers.grad_scaler_worker OUT_DIR PORT`; spawns two gloo
ranks on 127.0.0.1 and writes `OUT_DIR/rank{r}.npz`. At step `POISONED` one
gradient element on rank 1 only is set to inf.

- `group_*` / `no_group_*`: plain tensors, each rank training on its own
  data (no gradient all-reduce), with `process_group=WORLD` / without it.
- `fsdp2_torch` / `fsdp2_ours` / `fsdp2_extras`: an FSDP2 (`fully_shard`)
  model on a CPU mesh, whose DTensor gradients are sharded over the ranks,
  with torch's scaler, ours, and ours with `growth_policy="headroom"`,
  `hysteresis=2` and telemetry.
"""

import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lossscale.torch as lt

STEPS = 6
POISONED = 2


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def sharded_model(mesh):
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def train(rank, model, scaler, kind):
    opt = torch.optim.AdamW(
        model.parameters(), lr=0.01, fused=kind == "fused", foreach=kind != "fused"
    )
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    first = next(iter(model.parameters()))
    scales, steps = [], []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if step == POISONED and rank == 1:
            local(first.grad).view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        steps.append(int(opt.state[first]["step"]) if "step" in opt.state[first] else 0)
    params = np.concatenate([local(p).detach().reshape(-1).numpy() for p in model.parameters()])
    return {"scales": np.array(scales), "steps": np.array(steps), "params": params}


def run(rank, out_dir, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        settings = dict(init_scale=2.0**10, growth_interval=2)
        runs = {}
        for name, group in (("group", dist.group.WORLD), ("no_group", None)):
            for kind in ("fused", "foreach"):
                scaler = lt.GradScaler("cpu", **settings, process_group=group)
                runs[f"{name}_{kind}"] = train(rank, make_model(), scaler, kind)
        mesh = init_device_mesh("cpu", (2,))
        scalers = {
            "fsdp2_torch": torch.amp.GradScaler("cpu", **settings),
            "fsdp2_ours": lt.GradScaler("cpu", **settings),
            "fsdp2_extras": lt.GradScaler(
                "cpu", **settings, growth_policy="headroom", hysteresis=2, telemetry=True
            ),
        }
        for name, scaler in scalers.items():
            runs[name] = train(rank, sharded_model(mesh), scaler, "fused")
        runs["fsdp2_extras"]["skipped"] = np.array(
            scalers["fsdp2_extras"].summary()["skipped_steps"]
        )
        flat = {f"{name}/{key}": value for name, r in runs.items() for key, value in r.items()}
        np.savez(f"{out_dir}/rank{rank}.npz", **flat)
        dist.barrier()  # every rank done with its collectives before gloo shuts down
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    out_dir, port = sys.argv[1], int(sys.argv[2])
    torch.multiprocessing.spawn(run, args=(out_dir, port), nprocs=2)
