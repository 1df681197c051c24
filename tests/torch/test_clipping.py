"""lossscale/torch/clipping.py and the Accelerate recipe: clipping sees unscaled gradients,
skipped steps are visible, fused optimizers included."""

import pytest
import torch

import lossscale.torch as lt

SCALE = 2.0**10


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _optimizer(kind, params):
    if kind == "lossscale":  # its step always runs, skipping itself, as a fused kernel does
        import lossscale as ls

        return lt.Optimizer(params, ls.optimizers.AdamW(learning_rate=0.1))
    return torch.optim.AdamW(params, lr=0.1, fused=kind == "fused")


def _run(kind, clip):
    """The Accelerate recipe of docs/torch_switching.md on CPU: five steps, an inf loss at step 1."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    scaler = accelerator.scaler = lt.GradScaler("cpu", init_scale=SCALE, growth_interval=100)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = _optimizer(kind, model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    norms, true_norms, skipped, accelerate_skipped = [], [], [], []
    for step in range(5):
        loss = model(x).square().mean() * 10.0 * (float("inf") if step == 1 else 1.0)
        accelerator.backward(loss)  # scaler.scale(loss).backward()
        unscaled = [p.grad / scaler.get_scale() for p in model.parameters()]
        true_norms.append(
            float(torch.linalg.vector_norm(torch.cat([g.view(-1) for g in unscaled])))
        )
        if clip == "helper":
            norm = lt.clip_grad_norm_(model.parameters(), 1.0, scaler=scaler, optimizer=optimizer)
            norms.append(float(norm))
        else:  # by hand: unscale the optimizer Accelerate's step hands the scaler
            scaler.unscale_(optimizer.optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()  # scaler.step(optimizer); scaler.update()
        optimizer.zero_grad()
        skipped.append(scaler.last_step_skipped)
        accelerate_skipped.append(optimizer.step_was_skipped)
    return norms, true_norms, skipped, accelerate_skipped, list(model.parameters())


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("kind", ["foreach", "fused", "lossscale"])
def test_the_accelerate_recipe_clips_unscaled_gradients_and_sees_skipped_steps(kind):
    norms, true_norms, skipped, accelerate_skipped, params = _run(kind, clip="helper")
    # The norm clipped is the unscaled gradients' (scaled it would be 1024x).
    finite = [k for k in range(5) if k != 1]
    for k in finite:
        assert norms[k] == pytest.approx(true_norms[k], rel=1e-6)
        assert 1.0 < true_norms[k] < 100.0
    assert skipped == [False, True, False, False, False]
    # Accelerate's own flag watches `optimizer.step` calls; a fused torch
    # optimizer and `lossscale.torch.Optimizer` are always called (they skip
    # themselves): Accelerate's flag misses the skip there, the scaler's does not.
    assert accelerate_skipped == (skipped if kind == "foreach" else [False] * 5)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    by_hand = _run(kind, clip="by hand")
    assert torch.equal(
        torch.tensor(by_hand[0]).nan_to_num(-1.0), torch.tensor(norms).nan_to_num(-1.0)
    )
    assert all(torch.equal(p, q) for p, q in zip(params, by_hand[4]))


def test_without_the_helper_accelerate_on_cpu_clips_the_scaled_gradients(fresh_accelerate_state):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.scaler = lt.GradScaler("cpu", init_scale=SCALE)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.ones(8, 4)).square().mean())
    scaled = torch.linalg.vector_norm(torch.cat([p.grad.view(-1) for p in model.parameters()]))
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    assert float(norm) == pytest.approx(float(scaled))  # Accelerate's behaviour, not ours


def test_helper_without_a_scaler_only_clips():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    optimizer = torch.optim.SGD([p], lr=0.1)
    assert float(lt.clip_grad_norm_([p], 1.0, scaler=None, optimizer=optimizer)) == 6.0
    assert float(torch.linalg.vector_norm(p.grad)) == pytest.approx(1.0, rel=1e-5)


def test_last_step_skipped_is_none_before_an_update_and_after_a_new_scale():
    scaler = lt.GradScaler("cpu", init_scale=8.0)
    assert scaler.last_step_skipped is None
    scaler.scale(torch.ones(()))
    scaler.update(4.0)
    assert scaler.last_step_skipped is None
