"""lossscale.torch.GradScaler and sparse gradients (`nn.Embedding(sparse=True)`).

torch's scaler unscales a sparse gradient's values (coalescing a float16
one first, so that rows summed are checked) and hands the optimizer the
sparse gradient; ours gives the same weights, bit for bit, and the same
scales, with the native sparse-capable optimizers, an inf loss and a single
bad value at the edges and at a random place of the gradient's values.
"""

import pytest
import torch

import lossscale.torch as lt

VOCABULARY, WIDTH, LOOKUPS = 50_000, 64, 512
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sparse_adam": lambda p: torch.optim.SparseAdam(p, lr=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def run(scaler_class, name, bad_value_at=None):
    """Five steps; step 1's loss is inf, step 3's gradient holds one inf value at `bad_value_at`."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(VOCABULARY, WIDTH, sparse=True)
    head = torch.nn.Linear(WIDTH, 1)
    params = [*embedding.parameters(), *head.parameters()]
    sparse_params, dense_params = params[:1], params[1:]
    optimizers = [OPTIMIZERS[name](sparse_params), torch.optim.SGD(dense_params, lr=0.1)]
    scaler = scaler_class("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for step in range(5):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCABULARY, (LOOKUPS,), generator=generator)
        ids[: LOOKUPS // 2] = torch.randint(0, 30, (LOOKUPS // 2,), generator=generator)
        loss = head(embedding(ids)).square().mean() * (float("inf") if step == 1 else 1.0)
        for opt in optimizers:
            opt.zero_grad()
        scaler.scale(loss).backward()
        if step == 3 and bad_value_at is not None:
            grad = embedding.weight.grad.coalesce()
            values = grad.values().clone()
            values[bad_value_at] = float("inf")
            embedding.weight.grad = torch.sparse_coo_tensor(
                grad.indices(), values, grad.shape, check_invariants=True
            )
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in params], scales


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sparse_gradients_train_as_under_torchs_scaler(name):
    theirs, their_scales = run(torch.amp.GradScaler, name)
    ours, our_scales = run(lt.GradScaler, name)
    assert our_scales == their_scales and our_scales[1] == our_scales[0] / 2
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("where", ["first", "last", "random"])
def test_one_bad_value_in_a_sparse_gradient_skips_the_step(where):
    rows = {"first": (0, 0), "last": (-1, WIDTH - 1), "random": (137, 41)}[where]
    theirs, their_scales = run(torch.amp.GradScaler, "sparse_adam", rows)
    ours, our_scales = run(lt.GradScaler, "sparse_adam", rows)
    assert our_scales == their_scales and our_scales[3] == our_scales[2] / 2
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
