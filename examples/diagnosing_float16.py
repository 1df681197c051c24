import torch
import torch.nn.functional as F

import lossscale as ls


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(64, 32)
        self.out = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


torch.manual_seed(0)
x = torch.rand(256, 64) * 255  # raw pixel values, not normalised
y = torch.randint(0, 10, (256,))


def make(**settings):
    torch.manual_seed(1)
    model = Net()
    with torch.no_grad():
        model.hidden.weight /= 255  # so that the activations are of order 1
    # Named variables: summary() and LossScaleError then say "hidden.weight".
    variables = [ls.Variable(p, name=n) for n, p in model.named_parameters()]
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(1e-3), **settings)
    opt.build(variables)  # before the first scale_loss, which records the loss's flag
    return model, variables, opt


def step(model, variables, opt, x):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y)
    opt.scale_loss(loss).backward()
    opt.apply([p.grad for p in model.parameters()], variables)
    model.zero_grad()


def show(summary, key):
    for name, measured in summary["float16_range"].items():
        print(f"  {name:<13} {key} {measured[key]:.2g}")


# 1. An overflow, traced to its variable.
model, variables, opt = make(initial_scale=2.0**16, telemetry=True, diagnostics_every=1)
step(model, variables, opt, x)
summary = opt.summary()
print("overflows:", summary["overflows"])
show(summary, "max_abs")

# 2. A NaN loss told apart from an overflow.
model, variables, opt = make(initial_scale=2.0**19, max_consecutive_skips=1)
bad = x.clone()
bad[3, 5] = float("nan")  # one bad pixel: the loss is NaN
step(model, variables, opt, bad)
try:
    step(model, variables, opt, x)  # at 2^18: hidden.weight's gradient overflows
except ls.LossScaleError as error:
    lines = str(error).splitlines()
    print("\n".join([lines[0]] + [line for line in lines if line.startswith("  step ")]))

# 3. A scale that is too low, shown by the subnormal share.
for scale in (1.0, 2.0**8):
    model, variables, opt = make(initial_scale=scale, diagnostics_every=1)
    step(model, variables, opt, x)
    print(f"initial_scale={scale:g}:")
    show(opt.summary(), "subnormal")

# 4. The statistics policy: no growth into an overflow.
for policy in ("fixed", "statistics"):
    model, variables, opt = make(
        initial_scale=2.0**10,
        dynamic_growth_steps=20,
        growth_policy=policy,
        diagnostics_every=20,
        telemetry=True,
    )
    for _ in range(300):
        step(model, variables, opt, x)
    summary = opt.summary()
    print(f"{policy}: {summary['skipped_steps']} skipped, scale {summary['dynamic_scale']:g}")
