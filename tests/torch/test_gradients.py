"""torch/gradients.py: the groups a `GradScaler`'s gradients span, the flags it combines, and a
sparse gradient's stored values.

`merge_flags` against the maximum taken by hand; `mesh_groups` of dense,
sparse and missing gradients across param groups (none), and of a DTensor
gradient of a one-rank gloo group (the group of each mesh dimension it is
sharded over). Several ranks: tests/workers/fsdp2_worker.py.
"""

import torch

from lossscale.torch import gradients


def test_merge_flags_takes_the_maximum_per_device_and_keeps_the_others():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    found = {cpu: torch.tensor(0.0)}
    more = {cpu: torch.tensor(1.0), meta: torch.zeros((), device="meta")}
    merged = gradients.merge_flags(found, more)
    assert list(merged) == [cpu, meta] and float(merged[cpu]) == 1.0
    assert merged[meta] is more[meta] and merged[meta].device == meta
    # Not a sum: a fused kernel skips only on exactly 1.0.
    assert float(gradients.merge_flags(merged, {cpu: torch.tensor(1.0)})[cpu]) == 1.0
    assert (
        float(gradients.merge_flags({cpu: torch.tensor(1.0)}, {cpu: torch.tensor(0.0)})[cpu]) == 1.0
    )
    assert float(found[cpu]) == 0.0 and list(found) == [cpu]  # the inputs are left alone


def test_plain_dense_sparse_and_missing_gradients_span_no_group():
    generator = torch.Generator().manual_seed(0)
    dense = torch.nn.Parameter(torch.randn(3, 4, generator=generator))
    missing = torch.nn.Parameter(torch.randn(2, generator=generator))
    embedded = torch.nn.Parameter(torch.randn(5, 2, generator=generator))
    opt = torch.optim.SGD([{"params": [dense, missing]}, {"params": [embedded], "lr": 0.5}])
    dense.grad = torch.randn(3, 4, generator=generator)
    indices, values = torch.tensor([[1, 4, 1]]), torch.randn(3, 2, generator=generator)
    embedded.grad = torch.sparse_coo_tensor(indices, values, (5, 2), check_invariants=True)
    assert gradients.mesh_groups(opt) == []


def test_a_dtensor_gradient_spans_the_groups_it_is_sharded_over(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        value = torch.arange(12.0).reshape(3, 4)
        sharded = torch.nn.Parameter(distribute_tensor(value, mesh, [Replicate(), Shard(0)]))
        replicated = torch.nn.Parameter(distribute_tensor(value, mesh, [Replicate(), Replicate()]))
        plain = torch.nn.Parameter(torch.ones(2))
        sharded.grad = distribute_tensor(value * 2, mesh, [Replicate(), Shard(0)])
        replicated.grad = distribute_tensor(value * 3, mesh, [Replicate(), Replicate()])
        plain.grad = torch.ones(2)
        opt = torch.optim.SGD([sharded, replicated, plain], lr=0.1)
        # Only the "shard" dimension, once however many gradients span it.
        assert gradients.mesh_groups(opt) == [mesh.get_group(1)]
    finally:
        dist.destroy_process_group()


def test_a_float16_sparse_gradient_is_checked_as_coalesced():
    """Two float16 entries for one row sum past float16's range only once coalesced."""
    values = torch.full((2, 3), 40000.0, dtype=torch.float16)
    grad = torch.sparse_coo_tensor(torch.tensor([[4, 4]]), values, (10, 3))
    assert not torch.isfinite(gradients.stored_values(grad)).all()
    assert torch.isfinite(gradients.stored_values(grad.float())).all()  # float32: the sum is finite
    dense = torch.ones(3)
    assert gradients.stored_values(dense) is dense
