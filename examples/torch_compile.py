"""A float16 training step compiled whole, `fullgraph=True`, checkpointed with `state_dict()`.

The whole step (forward under float16 autocast, the scaled backward by
`torch.autograd.grad`, `opt.apply`) is one graph: `apply` reads no tensor
on the host (the finite check, the skip and the loss-scale update stay on
the device), so nothing breaks the graph and no step waits for the GPU.
What torch needs for it: `torch._dynamo.config.trace_autograd_ops = True`,
so that Dynamo traces `torch.autograd.grad` into the graph, and the
optimizer built (`opt.build`) before the first compiled call. Halfway, the
optimizer state goes through `torch.save` / `torch.load` into a fresh
optimizer, which carries on exactly where the first left off.

    python examples/torch_compile.py [BACKEND]   # default: inductor
"""

import io
import sys

import torch
from torch import nn

import lossscale as ls

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
backend = sys.argv[1] if len(sys.argv) > 1 else "inductor"

x = torch.randn(4096, 32, device=device)
y = (x @ torch.randn(32, device=device) > 0).long()
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
params = list(model.parameters())


def make_optimizer():
    opt = ls.LossScaleOptimizer(
        ls.optimizers.Adam(learning_rate=3e-3), initial_scale=2.0**15, dynamic_growth_steps=100
    )
    opt.build(params)  # outside the compiled step: creating state is one-off work
    return opt


def make_step(opt):
    def step(xb, yb):
        with torch.autocast(device_type=device, dtype=torch.float16):
            logits = model(xb)
        loss = nn.functional.cross_entropy(logits.float(), yb)
        grads = torch.autograd.grad(opt.scale_loss(loss), params)
        opt.apply(grads, params)
        return loss.detach()

    return torch.compile(step, backend=backend, fullgraph=True)


torch._dynamo.config.trace_autograd_ops = True  # autograd.grad inside the graph
opt = make_optimizer()
step = make_step(opt)
for i in range(300):
    if i == 150:  # checkpoint and resume, as a restarted job would
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        opt = make_optimizer()
        opt.load_state_dict(torch.load(buffer, weights_only=True))
        step = make_step(opt)
    batch = torch.randint(0, len(x), (128,), device=device)
    loss = step(x[batch], y[batch])
    if i % 100 == 0:
        print(f"step {i:3d}  loss {float(loss):.4f}  scale {float(opt.dynamic_scale):g}")

with torch.no_grad():
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
print(
    f"accuracy {accuracy:.3f}  loss scale {float(opt.dynamic_scale):g}  "
    f"steps applied {int(opt.iterations)}"
)
