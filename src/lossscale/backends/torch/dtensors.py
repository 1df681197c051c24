"""DTensor support (FSDP2): optimizer state sharded like the parameters it follows.

State made next to a sharded parameter is sharded alike (`shard_like`); the
step runs under implicit replication (`replicating`), so plain scalars count
as replicated; packing tricks leave DTensors alone (`is_dtensor`).
torch.distributed.tensor is consulted only once imported.
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
    """`x` as a plain tensor: a DTensor's global value (its `full_tensor()`), else `x`."""
    return x.full_tensor() if is_dtensor(x) else x


def shard_like(tensor, like):
    """`tensor` (a plain tensor of `like`'s global shape) as a DTensor sharded like `like`."""
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
