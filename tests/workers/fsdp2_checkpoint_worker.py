"""Two-rank FSDP2 runs saved and resumed through torch's distributed checkpoint (DCP).

Run as `python -m tests.workers.fsdp2_checkpoint_worker OUT_DIR PORT`: spawns two
gloo ranks on 127.0.0.1. For each rule and each layout of torch's optimizer
state dict (nested, flattened), a model sharded with `fully_shard` trains
`SAVED` steps with `lossscale.torch.Optimizer` under `lossscale.torch.GradScaler`
(an inf in rank 1's shard at step `POISONED`: a skipped step), is saved with
`dcp.save`, and trains `RESUMED` steps more. A second model (other weights,
fresh optimizer) loads the checkpoint with `dcp.load` + `set_state_dict` and
trains the same steps. Writes `OUT_DIR/rank{r}.npz`: per run, the full
parameters at the end of both, whether taking the state dict changed this
rank's optimizer state, and the scales of both.
"""

import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

import lossscale as ls
import lossscale.torch as lt

SAVED, RESUMED = 3, 3
POISONED = 1
BATCH = 8  # per rank

RULES = {
    "adamw": lambda: ls.optimizers.AdamW(1e-2, weight_decay=0.05),
    "sgd_momentum": lambda: ls.optimizers.SGD(1e-2, momentum=0.9),
    "sgd": lambda: ls.optimizers.SGD(1e-2),
}
LAYOUTS = ("nested", "flattened")


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _train(model, opt, scaler, steps, rank):
    scales = []
    for k in steps:
        x, y = batch(k, rank)
        opt.zero_grad(set_to_none=True)  # grads None between steps, as at a save
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if k == POISONED and rank == 1:
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    opt.zero_grad(set_to_none=True)
    return scales


def _local_state(opt):
    """This rank's optimizer state (local shards), as NumPy arrays."""

    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).detach().numpy().copy()

    saved = opt.state_dict()
    arrays = [local(t) for i in sorted(saved["state"]) for t in saved["state"][i].values()]
    for group in saved["param_groups"]:
        arrays += [local(t) for t in group["optimizer_variables"].values()]
    return arrays


def _sharded(seed, rule):
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed)
    fully_shard(model)
    opt = lt.Optimizer(model.parameters(), RULES[rule]())
    return model, opt, lt.GradScaler("cpu", init_scale=2.0**6, growth_interval=2)


def _full(p):
    return p.full_tensor().detach().numpy().copy()


def run_one(rule, layout, rank, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    options = dsd.StateDictOptions(flatten_optimizer_state_dict=layout == "flattened")
    model, opt, scaler = _sharded(0, rule)
    scales = _train(model, opt, scaler, range(SAVED), rank)
    before = _local_state(opt)
    model_sd, optim_sd = dsd.get_state_dict(model, opt, options=options)
    after = _local_state(opt)
    changed = any(not np.array_equal(a, b) for a, b in zip(before, after))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    scaler_state = scaler.state_dict()
    scales += _train(model, opt, scaler, range(SAVED, SAVED + RESUMED), rank)

    twin, twin_opt, twin_scaler = _sharded(1, rule)
    twin_model_sd, twin_optim_sd = dsd.get_state_dict(twin, twin_opt, options=options)
    loaded = {"model": twin_model_sd, "optim": twin_optim_sd}
    dcp.load(loaded, checkpoint_id=directory)
    dsd.set_state_dict(
        twin,
        twin_opt,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optim"],
        options=options,
    )
    twin_scaler.load_state_dict(scaler_state)
    twin_scales = _train(twin, twin_opt, twin_scaler, range(SAVED, SAVED + RESUMED), rank)
    return {
        "changed_by_get": np.array(changed),
        "scales": np.array(scales),
        "resumed_scales": np.array(twin_scales),
        **{f"param{i}": _full(p) for i, p in enumerate(model.parameters())},
        **{f"resumed_param{i}": _full(p) for i, p in enumerate(twin.parameters())},
    }


def _train_wrapper(model, opt, steps, rank):
    scales = []
    for k in steps:
        x, y = batch(k, rank)
        opt.scale_loss(torch.nn.functional.mse_loss(model(x), y)).backward()
        grads = [p.grad for p in model.parameters()]
        if k == POISONED and rank == 1:
            grads[0].to_local().view(-1)[0] = float("inf")
        opt.apply(grads, list(model.parameters()))
        model.zero_grad(set_to_none=True)
        scales.append(float(opt.dynamic_scale))
    return scales


def _sharded_wrapper(seed):
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed)
    fully_shard(model)
    opt = ls.LossScaleOptimizer(
        ls.optimizers.AdamW(1e-2, weight_decay=0.05),
        initial_scale=2.0**6,
        dynamic_growth_steps=2,
        telemetry=True,
    )
    opt.build(list(model.parameters()))
    return model, opt


def run_wrapper(rank, directory):
    """`LossScaleOptimizer` (telemetry on): its own `state_dict()` through `dcp.save` / `dcp.load`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    model, opt = _sharded_wrapper(0)
    scales = _train_wrapper(model, opt, range(SAVED), rank)
    dcp.save(
        {"model": dsd.get_model_state_dict(model), "optim": opt.state_dict()},
        checkpoint_id=directory,
    )
    scales += _train_wrapper(model, opt, range(SAVED, SAVED + RESUMED), rank)

    twin, twin_opt = _sharded_wrapper(1)
    # The template a load fills in place: the fresh run's own dicts.
    loaded = {"model": dsd.get_model_state_dict(twin), "optim": twin_opt.state_dict()}
    dcp.load(loaded, checkpoint_id=directory)
    dsd.set_model_state_dict(twin, loaded["model"])
    twin_opt.load_state_dict(loaded["optim"])
    twin_scales = _train_wrapper(twin, twin_opt, range(SAVED, SAVED + RESUMED), rank)
    summary, twin_summary = opt.summary(), twin_opt.summary()
    return {
        "changed_by_get": np.array(False),  # its own state_dict() steps nothing
        "scales": np.array(scales),
        "resumed_scales": np.array(twin_scales),
        "same_summary": np.array(repr(summary) == repr(twin_summary)),
        **{f"param{i}": _full(p) for i, p in enumerate(model.parameters())},
        **{f"resumed_param{i}": _full(p) for i, p in enumerate(twin.parameters())},
    }


def run(rank, out_dir, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    warnings.simplefilter("ignore")
    try:
        results = {}
        for rule in RULES:
            for layout in LAYOUTS:
                directory = f"{out_dir}/{rule}-{layout}"
                for key, value in run_one(rule, layout, rank, directory).items():
                    results[f"{rule}-{layout}/{key}"] = value
        for key, value in run_wrapper(rank, f"{out_dir}/wrapper").items():
            results[f"wrapper/{key}"] = value
        np.savez(f"{out_dir}/rank{rank}.npz", **results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(run, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
