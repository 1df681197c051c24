"""Two-rank FSDP2 runs with every `LossScalePolicy` option, for tests/torch/test_fsdp2_options.py.

Run as `python -m tests.workers.fsdp2_options_worker OUT_DIR PORT`: spawns two gloo
ranks on 127.0.0.1 and trains `fsdp2_worker`'s model, sharded with
`fully_shard`, once per (interface, option): `LossScaleOptimizer`,
`lossscale.torch.Optimizer` under `lossscale.torch.GradScaler`, and a torch
optimizer under `lossscale.torch.GradScaler`. At step `POISONED` rank 1's
shard of the first gradient holds an inf. Each rank writes
`OUT_DIR/rank{r}.npz`: per run the loss scales, the summary (as its repr),
the step at which a `LossScaleError` was raised (-1: none) and the full
parameters.
"""

import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

import lossscale as ls
import lossscale.torch as lt
from tests.workers.fsdp2_worker import BATCH, POISONED, STEPS, data, make_model

INITIAL = 2.0**6  # grows at step 1 (every 2 finite steps), backs off at POISONED

OPTIONS = {
    "telemetry": dict(telemetry=True),
    "max_consecutive_skips": dict(max_consecutive_skips=0),  # the poisoned step raises
    # Grown to 96 at step 1, the backoff at POISONED (to 48) raises.
    "min_scale": dict(min_scale=INITIAL, growth_factor=1.5),
    "headroom": dict(growth_policy="headroom", telemetry=True),
    "hysteresis": dict(hysteresis=2, telemetry=True),  # skipped, no backoff
    # Decided on the float16 range each rank measures of its own shard.
    "statistics": dict(growth_policy="statistics", diagnostics_every=1, telemetry=True),
}


def _wrapper(params, options):
    opt = ls.LossScaleOptimizer(
        ls.optimizers.Adam(1e-2), initial_scale=INITIAL, dynamic_growth_steps=2, **options
    )

    def step(model, loss, poison):
        opt.scale_loss(loss).backward()
        grads = [p.grad for p in model.parameters()]
        poison(grads[0])
        try:
            opt.apply(grads, list(model.parameters()))
        finally:
            model.zero_grad()
        return float(opt.dynamic_scale)

    return step, opt.summary


def _scaled(optimizer, options):
    scaler = lt.GradScaler("cpu", init_scale=INITIAL, growth_interval=2, **options)

    def step(model, loss, poison):
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        poison(next(model.parameters()).grad)
        scaler.step(optimizer)
        scaler.update()
        return scaler.get_scale()

    return step, scaler.summary


INTERFACES = {
    "loss_scale_optimizer": _wrapper,
    "torch_optimizer": lambda params, options: _scaled(
        lt.Optimizer(params, ls.optimizers.AdamW(1e-2, weight_decay=0.05)), options
    ),
    "grad_scaler": lambda params, options: _scaled(torch.optim.AdamW(params, lr=1e-2), options),
}

RUNS = [(interface, option) for interface in INTERFACES for option in OPTIONS]


def train(interface, option, model, x, y, poison):
    """Returns the scales, the summary's repr and the step that raised (or -1)."""
    step, summary = INTERFACES[interface](list(model.parameters()), OPTIONS[option])
    scales, raised = [], -1
    for k in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        try:
            scales.append(step(model, loss, lambda g, k=k: poison(g, k)))
        except ls.LossScaleError:
            raised = k
            break
    return scales, repr(summary()), raised


def run(rank, out_dir, port):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    warnings.simplefilter("ignore")
    try:
        x, y = data()
        mine = slice(rank * BATCH, (rank + 1) * BATCH)

        def poison(grad, k):
            if k == POISONED and rank == 1:
                grad.to_local().view(-1)[0] = float("inf")

        results = {}
        for interface, option in RUNS:
            model = make_model()
            fully_shard(model)
            key = f"{interface}-{option}"
            scales, summary, raised = train(interface, option, model, x[mine], y[mine], poison)
            results[f"{key}/scales"] = np.array(scales)
            results[f"{key}/summary"] = np.array(summary)
            results[f"{key}/raised"] = np.array(raised)
            for i, p in enumerate(model.parameters()):
                results[f"{key}/param{i}"] = p.full_tensor().detach().numpy().copy()
        np.savez(f"{out_dir}/rank{rank}.npz", **results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(run, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
