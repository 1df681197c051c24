import torch
import lossscale.torch

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # any torch.optim optimizer
# torch.amp.GradScaler's API and defaults, lossscale's state machine and extras:
scaler = lossscale.torch.GradScaler("cpu", hysteresis=2, max_consecutive_skips=50)
x = torch.randn(256, 16)
for _ in range(200):
    with torch.autocast("cpu", dtype=torch.float16):  # "cuda" on a GPU
        loss = torch.nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True) / 4)
    scaler.scale(loss).backward()
    scaler.step(opt)  # unscale, skip the step if a gradient overflowed
    scaler.update()
    opt.zero_grad()
print(f"loss {loss.item():.4g}  loss scale {scaler.get_scale():g}")
