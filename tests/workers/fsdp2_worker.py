"""Two-rank FSDP2 (`fully_shard`) runs for tests/backends/torch/test_dtensors.py.

Run as `python -m tests.workers.fsdp2_worker OUT_DIR PORT`: spawns two gloo ranks on
127.0.0.1, trains the same small model with each interface, and writes
`OUT_DIR/rank{r}.npz` (the full parameters after every run, gathered from the
shards, and each run's loss scales). At step `POISONED` rank 1's shard of the
first gradient holds an inf: every rank must skip that step.
"""

import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

import lossscale as ls
import lossscale.torch as lt

STEPS = 6
POISONED = 3
BATCH = 8  # per rank


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(2 * BATCH, 8, generator=g), torch.randn(2 * BATCH, 4, generator=g)


# Interface name -> (makes its optimizer for the parameters, runs one step).
def _wrapper(inner):
    def make(params):
        return ls.LossScaleOptimizer(inner(), initial_scale=2.0**6, dynamic_growth_steps=2)

    def step(opt, model, loss, poison):
        opt.scale_loss(loss).backward()
        grads = [p.grad for p in model.parameters()]
        poison(grads[0])
        opt.apply(grads, list(model.parameters()))
        model.zero_grad()
        return float(opt.dynamic_scale)

    return make, step


def _torch_optimizer(params):
    return lt.Optimizer(params, ls.optimizers.AdamW(1e-2, weight_decay=0.05)), lt.GradScaler(
        "cpu", init_scale=2.0**6, growth_interval=2
    )


def _torch_optimizer_step(pair, model, loss, poison):
    opt, scaler = pair
    opt.zero_grad()
    scaler.scale(loss).backward()
    poison(next(model.parameters()).grad)
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale()


class PerVariableAdam(ls.optimizers.Adam):
    """Adam's `update_step` one variable at a time (a subclass gets no kernel)."""


RUNS = {
    "adam": _wrapper(lambda: ls.optimizers.Adam(1e-2)),
    "adam_per_variable": _wrapper(lambda: PerVariableAdam(1e-2)),
    "lion": _wrapper(lambda: ls.optimizers.Lion(1e-3)),
    "adamw_clipped": _wrapper(lambda: ls.optimizers.AdamW(1e-2, global_clipnorm=0.5)),
    # DTensor has no sharding strategy for `_fused_sgd_`: shards take the foreach rule.
    "sgd": _wrapper(lambda: ls.optimizers.SGD(1e-2)),
    "sgd_nesterov": _wrapper(lambda: ls.optimizers.SGD(1e-2, momentum=0.9, nesterov=True)),
    "torch_optimizer": (_torch_optimizer, _torch_optimizer_step),
}


def train(name, model, x, y, poison, half=False):
    make, step = RUNS[name]
    opt = make(list(model.parameters()))
    scales = []
    for k in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16, enabled=half):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scales.append(step(opt, model, loss, lambda g, k=k: poison(g, k)))
    return scales


def _full(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()


def run(rank, out_dir, port):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    warnings.simplefilter("ignore")
    try:
        x, y = data()
        mine = slice(rank * BATCH, (rank + 1) * BATCH)

        def poison(grad, k):
            if k == POISONED and rank == 1:
                grad.to_local().view(-1)[0] = float("inf")

        results = {}
        for name in RUNS:
            for half in (False, True):
                model = make_model()
                policy = MixedPrecisionPolicy(param_dtype=torch.float16) if half else None
                fully_shard(model, **({"mp_policy": policy} if policy else {}))
                key = f"{name}_{'fp16' if half else 'fp32'}"
                results[f"{key}/scales"] = np.array(
                    train(name, model, x[mine], y[mine], poison, half)
                )
                for i, p in enumerate(model.parameters()):
                    results[f"{key}/param{i}"] = _full(p)
        np.savez(f"{out_dir}/rank{rank}.npz", **results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(run, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
