"""The gradients a `GradScaler` checks, and the overflow flags it combines."""

import sys

import torch


def merge_flags(found, more):
    """Per-device overflow flags of two checks, combined by their maximum."""
    merged = dict(found)
    for device, flag in more.items():
        merged[device] = torch.maximum(merged[device], flag) if device in merged else flag
    return merged


def local_gradients(optimizer):
    """The optimizer's gradients as local tensors, and the groups their shards span.

    A DTensor gradient (FSDP2) contributes its local shard, and the process
    group of each mesh dimension it is not replicated over, so that a
    reduction over those groups covers the whole gradient.
    """
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    grads, groups = [], {}
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if dtensor is not None and isinstance(grad, dtensor):
                mesh = grad.device_mesh
                for dim, placement in enumerate(grad.placements):
                    if not placement.is_replicate():
                        groups.setdefault((id(mesh), dim), mesh.get_group(dim))
                grad = grad.to_local()
            if grad.is_sparse:
                grad = grad.coalesce()._values()
            grads.append(grad)
    return grads, list(groups.values())
