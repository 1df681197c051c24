"""The process groups a `GradScaler`'s gradients span, the overflow flags it combines, and a
sparse gradient's stored values."""

import sys

import torch


def merge_flags(found, more):
    """Per-device overflow flags of two checks, combined by their maximum."""
    merged = dict(found)
    for device, flag in more.items():
        merged[device] = torch.maximum(merged[device], flag) if device in merged else flag
    return merged


def mesh_groups(optimizer):
    """The process groups of the mesh dimensions a DTensor gradient (FSDP2) is sharded over."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:  # not imported: no gradient is a DTensor
        return []
    groups = {}
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            grad = param.grad
            if isinstance(grad, dtensor):
                mesh = grad.device_mesh
                for dim, placement in enumerate(grad.placements):
                    if not placement.is_replicate():
                        groups.setdefault((id(mesh), dim), mesh.get_group(dim))
    return list(groups.values())


def stored_values(grad):
    """The values `grad` stores: itself, or a sparse gradient's values, coalesced.

    Coalesced so that entries for one index that sum past the dtype's range
    count as the overflow they make when applied.
    """
    if grad.layout == torch.strided:
        return grad
    if grad.layout == torch.sparse_coo:
        return grad.coalesce()._values()
    return grad.values()
