"""DTensor support: optimizer state sharded like the parameters it follows.

FSDP2 (`torch.distributed.fsdp.fully_shard`) turns a model's parameters and
gradients into DTensors, each rank holding a shard. Optimizer code needs
three things for them:

- state made next to a sharded parameter is sharded the same way (`shard_like`),
  so each rank keeps only its shard of the moments;
- the step runs with DTensor's implicit replication (`replicating`): a plain
  tensor met in DTensor arithmetic (the learning rate, the loss scale, a
  cached constant) counts as replicated on every rank;
- the CPU packing tricks, which copy tensors into one plain buffer, leave
  DTensors alone (`is_dtensor`).

Reductions over DTensors (norms, the finite check) are DTensor's own, global
over the mesh. torch.distributed.tensor is consulted only once it has been
imported: a DTensor cannot exist before.
"""

import contextlib
import sys

# Set once a DTensor has been seen: the step then enters implicit replication.
_SEEN = []


def _module():
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(x):
    """Whether `x` is a DTensor."""
    module = _module()
    return module is not None and isinstance(x, module.DTensor)


def seen(x):
    """Notes a DTensor among an optimizer's variables; returns `x`."""
    if not _SEEN and is_dtensor(x):
        _SEEN.append(True)
    return x


def plain(x):
    """`x` as a plain tensor: a DTensor's global value (its `full_tensor()`), else `x`.

    For a value DTensor's own reductions made (the finite flag over sharded
    gradients, a norm, a peak) that is the value every rank agrees on; the
    process-group collectives take only plain tensors.
    """
    return x.full_tensor() if is_dtensor(x) else x


def shard_like(tensor, like):
    """`tensor` (a plain tensor of `like`'s global shape) as a DTensor sharded like `like`.

    Each rank keeps its own shard of the same global value (every rank made
    it alike, so nothing is sent).
    """
    module = _module()
    return seen(
        module.distribute_tensor(
            tensor.to(like.device), like.device_mesh, like.placements, src_data_rank=None
        )
    )


def replicating():
    """DTensor's implicit replication once DTensors are in use; else nothing."""
    if not _SEEN:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()
