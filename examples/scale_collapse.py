"""A float16 model whose scale collapses for a reason no back-off clears, found at its first step.

A stale gradient hook (left over from debugging) writes NaN into one layer's
gradient at every step. The scaler skips the step and halves the scale, again
and again; `on_persistent` calls a hook the first time the skip is found
persistent, which saves what is needed to debug it and stops the run.

Run: python examples/scale_collapse.py
"""

import torch

import lossscale.torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(256, 32), torch.randint(0, 4, (256,))


class Stop(Exception):
    pass


def on_persistent(summary):
    torch.save({"model": model.state_dict(), "batch": (x, y)}, "persistent.pt")
    raise Stop(summary)


scaler = lossscale.torch.GradScaler("cpu", init_scale=2.0**16, on_persistent=on_persistent)
lossscale.torch.watch(model, scaler)  # names the parameters, finds the module
for step in range(100):
    if step == 5:  # the bug: a hook that turns a finite gradient into NaN
        model[2].weight.register_hook(lambda g: g * float("nan"))
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    try:
        scaler.update()
    except Stop as stop:
        summary = stop.args[0]
        break

print(f"stopped at step {step}, scale {summary['dynamic_scale']:g}")
for overflow in summary["overflows"]:
    print(f"  step {overflow['step']}: {overflow['cause']}, {overflow['variables']}")
