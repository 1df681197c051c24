"""Mixed-precision training of a PyTorch `nn.Module` with autocast and LossScaleOptimizer.

Float16 autocast runs the matrix products in float16; the loss is scaled
before `backward()` so that small float16 gradients do not flush to zero,
and `apply` unscales the gradients, updates the module's parameters in
place, and skips the step (halving the scale) if any gradient overflowed.
Runs on CUDA when available, else on the CPU.

    python examples/torch_autocast.py
"""

import torch
from torch import nn

import lossscale as ls

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"

# A toy task: which side of a random hyperplane a point lies on.
x = torch.randn(4096, 32, device=device)
y = (x @ torch.randn(32, device=device) > 0).long()

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
params = list(model.parameters())
opt = ls.LossScaleOptimizer(
    ls.optimizers.Adam(learning_rate=3e-3), initial_scale=2.0**15, dynamic_growth_steps=100
)

for step in range(300):
    batch = torch.randint(0, len(x), (128,), device=device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        logits = model(x[batch])  # float16 activations
    loss = nn.functional.cross_entropy(logits.float(), y[batch])
    opt.scale_loss(loss).backward()
    opt.apply([p.grad for p in params], params)  # unscale, check, update in place
    model.zero_grad(set_to_none=True)
    if step % 100 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}  scale {float(opt.dynamic_scale):g}")

with torch.no_grad():
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
print(
    f"accuracy {accuracy:.3f}  loss scale {float(opt.dynamic_scale):g}  "
    f"steps applied {int(opt.iterations)}"
)
