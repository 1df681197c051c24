import torch
import lossscale as ls

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = ls.LossScaleOptimizer(ls.optimizers.Adam(learning_rate=1e-2))
x = torch.randn(256, 16)
for _ in range(200):
    with torch.autocast("cpu", dtype=torch.float16):  # "cuda" on a GPU
        loss = torch.nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True) / 4)
    opt.scale_loss(loss).backward()  # scaled, so small float16 gradients survive
    opt.apply([p.grad for p in model.parameters()], model.parameters())  # unscale, skip inf/NaN
    model.zero_grad()
print(f"loss {loss.item():.4g}  loss scale {float(opt.dynamic_scale):g}")
