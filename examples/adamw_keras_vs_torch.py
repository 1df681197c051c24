"""`ls.optimizers.AdamW` (Keras's AdamW) against `torch.optim.AdamW`, 50 float16 steps each.

Run: python examples/adamw_keras_vs_torch.py
"""

import copy

import torch

import lossscale as ls
import lossscale.torch

torch.manual_seed(0)
x = torch.randn(512, 16)
y = torch.sin(x[:, :4].sum(1, keepdim=True))
initial = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def loss_of(model):
    with torch.autocast("cpu", dtype=torch.float16):
        return torch.nn.functional.mse_loss(model(x).float(), y)


def with_scaler(scaler):  # a GradScaler loop around torch's own AdamW
    def train(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # weight_decay=0.01, eps=1e-8
        for _ in range(50):
            scaler.scale(loss_of(model)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    return train


def with_wrapper(make_inner):  # a LossScaleOptimizer loop
    def train(model):
        opt = ls.LossScaleOptimizer(make_inner(model), initial_scale=2.0**16)
        for _ in range(50):
            opt.scale_loss(loss_of(model)).backward()
            opt.apply([p.grad for p in model.parameters()], model.parameters())
            model.zero_grad()

    return train


runs = {
    "torch.amp.GradScaler + torch.optim.AdamW": with_scaler(torch.amp.GradScaler("cpu")),
    "lossscale.torch.GradScaler + torch.optim.AdamW": with_scaler(
        lossscale.torch.GradScaler("cpu")
    ),
    "LossScaleOptimizer(torch.optim.AdamW)": with_wrapper(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)
    ),
    "LossScaleOptimizer(ls.optimizers.AdamW)": with_wrapper(
        lambda m: ls.optimizers.AdamW(learning_rate=1e-2)  # weight_decay=0.004, epsilon=1e-7
    ),
    "  ... AdamW(weight_decay=0.01, epsilon=1e-8)": with_wrapper(
        lambda m: ls.optimizers.AdamW(learning_rate=1e-2, weight_decay=0.01, epsilon=1e-8)
    ),
}
reference = None
for name, train in runs.items():
    model = copy.deepcopy(initial)  # every run starts from the same weights
    train(model)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = weights if reference is None else reference
    same = "yes" if torch.equal(weights, reference) else "no"
    print(f"{name:46s} final loss {loss_of(model).item():.6f}  torch's weights bit for bit: {same}")
