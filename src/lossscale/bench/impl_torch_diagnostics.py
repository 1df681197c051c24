"""What the diagnostics cost on torch: GradScaler `diagnostics_every`, and `watch(model)`.

- `lossscale-gradscaler-adamw-fused-diagnostics` (and `...-every-step`):
  `impl_torch`'s `lossscale-gradscaler-adamw-fused` step with diagnostics.
- `...-window` and `...-diagnostics-window`: windows of `WINDOW` steps
  without and with diagnostics, the measured step amortised.
- `lossscale-gpt-train-step` (and `...-watch`): a whole float16 training
  step of a small GPT with the `gpt` workload's shapes, without and with
  `watch(model, scaler)`.
"""

from lossscale.bench import frameworks, impl_torch, workloads
from lossscale.bench.registry import TORCH, implementation
from lossscale.bench.timing import Stepper

DIAGNOSTICS_EVERY = 100
# Steps in one timed step of the `-window` rows: one measured step each.
WINDOW = DIAGNOSTICS_EVERY
# Tokens of one training step: sequences of a quarter of the context.
BATCH = 2


@implementation(
    "lossscale-gradscaler-adamw-fused-diagnostics",
    "ours",
    f"lossscale.torch.GradScaler(diagnostics_every={DIAGNOSTICS_EVERY}) + "
    "torch.optim.AdamW(fused=True)",
    **TORCH,
)
def grad_scaler_diagnostics(workload):
    return impl_torch.scaler_stepper(
        workload, scaler_kwargs={"diagnostics_every": DIAGNOSTICS_EVERY}, adamw=True, fused=True
    )


@implementation(
    "lossscale-gradscaler-adamw-fused-diagnostics-every-step",
    "ours",
    "lossscale.torch.GradScaler(diagnostics_every=1) + torch.optim.AdamW(fused=True): "
    "what one measured step costs",
    **TORCH,
)
def grad_scaler_diagnostics_every_step(workload):
    return impl_torch.scaler_stepper(
        workload, scaler_kwargs={"diagnostics_every": 1}, adamw=True, fused=True
    )


def _window(workload, scaler_kwargs):
    """`WINDOW` steps of `scaler_stepper(workload, scaler_kwargs)`, each gradient restored first."""
    single = impl_torch.scaler_stepper(workload, scaler_kwargs, adamw=True, fused=True)

    def window():
        for _ in range(WINDOW):
            single.prepare()
            single.step()

    return Stepper(step=window, sync=single.sync)


# Registered in the table's order: the baseline, then the row with diagnostics.
for _on in (False, True):
    implementation(
        f"lossscale-gradscaler-adamw-fused{'-diagnostics' if _on else ''}-window",
        "ours" if _on else "baseline",
        f"{WINDOW} steps of lossscale.torch.GradScaler"
        + (f"(diagnostics_every={DIAGNOSTICS_EVERY})" if _on else "")
        + " + torch.optim.AdamW(fused=True)"
        + (": the measured step amortised" if _on else ", no diagnostics"),
        **TORCH,
    )(
        lambda workload, _on=_on: _window(
            workload, {"diagnostics_every": DIAGNOSTICS_EVERY} if _on else {}
        )
    )
del _on


def _gpt(torch, workload):
    """A GPT-2-style torch model with the workload's shapes (see `workloads.GPT`)."""
    nn, F = torch.nn, torch.nn.functional
    (vocab, width), (context, _) = workload.shapes[0], workload.shapes[1]
    blocks = (len(workload.shapes) - 5) // 12
    heads = max(1, width // 32)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(width, 3 * width)
            self.c_proj = nn.Linear(width, width)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.c_attn(x).split(width, dim=2)
            q, k, v = (y.view(b, t, heads, width // heads).transpose(1, 2) for y in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, width))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(width, 4 * width)
            self.c_proj = nn.Linear(4 * width, width)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(width), Attention()
            self.ln_2, self.mlp = nn.LayerNorm(width), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
            self.h = nn.ModuleList(Block() for _ in range(blocks))
            self.ln_f = nn.LayerNorm(width)
            self.lm_head = nn.Linear(width, vocab, bias=False)

        def forward(self, tokens):
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(0)
    model = GPT()
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    if shapes != workload.shapes:
        raise ValueError(
            f"The GPT model's parameter shapes must be the workload's. Received: {shapes}"
        )
    return model, vocab, context


def _train_step(workload, watched):
    if not workload.name.endswith("gpt"):
        raise frameworks.Unavailable("the training step is built for the gpt workload only")
    torch, device = frameworks.torch_device(workload)
    import lossscale.torch

    model, vocab, context = _gpt(torch, workload)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = lossscale.torch.GradScaler(
        device.type,
        init_scale=workloads.LOSS_SCALE,
        growth_interval=workloads.GROWTH_STEPS,
        telemetry=True,
    )
    if watched:
        lossscale.torch.watch(model, scaler)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (BATCH, context // 4 + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16):
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return Stepper(step=step, sync=frameworks.torch_sync(torch, device))


@implementation(
    "lossscale-gpt-train-step",
    "ours",
    "a GPT training step: forward, backward, lossscale.torch.GradScaler(telemetry=True) + "
    "torch.optim.AdamW(fused=True)",
    **TORCH,
)
def gpt_train_step(workload):
    return _train_step(workload, watched=False)


@implementation(
    "lossscale-gpt-train-step-watch",
    "ours",
    "the GPT training step with lossscale.torch.watch(model, scaler)",
    **TORCH,
)
def gpt_train_step_watch(workload):
    return _train_step(workload, watched=True)
