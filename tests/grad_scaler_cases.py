"""The float16 training loop the GradScaler tests share.

A small transformer (embedding, one `nn.TransformerEncoderLayer(32, 2, 64)`,
a linear head) under `torch.autocast("cpu", dtype=torch.float16)`, trained
for a few dozen steps from a high initial scale, so that the first steps
overflow and the scale later grows and backs off again.
"""

import torch
import torch.nn.functional as F

VOCAB, WIDTH = 64, 32
STEPS = 32
INIT_SCALE = 2.0**24
GROWTH_INTERVAL = 3


class TinyTransformer(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.encoder = torch.nn.TransformerEncoderLayer(WIDTH, 2, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(
        0, VOCAB, (4, 8), generator=g
    )


def make_optimizer(model, kind):
    """AdamW, `"fused"` (unscales inside its kernel) or `"foreach"` (GradScaler unscales)."""
    fused = kind == "fused"
    return torch.optim.AdamW(
        model.parameters(), lr=3e-3, fused=fused, foreach=None if fused else True
    )


def applied_steps(optimizer):
    """How many steps the optimizer took (a skipped fused step takes its count back)."""
    first = optimizer.param_groups[0]["params"][0]
    state = optimizer.state.get(first, {})
    return int(state["step"]) if "step" in state else 0


def loss_of(model, tokens, targets):
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def train(scaler, kind="fused", clip=None, steps=STEPS, poison=(), model=None, optimizer=None):
    """Runs the loop; returns the scales, which steps were skipped, and the weights.

    Args:
        scaler: A `torch.amp.GradScaler` (torch's or ours).
        kind: The optimizer, see `make_optimizer`.
        clip: Optional max norm: `unscale_` and `clip_grad_norm_` before each step.
        steps: Number of steps.
        poison: Steps whose loss is multiplied by inf.
        model, optimizer: To continue a run.
    """
    model = model if model is not None else TinyTransformer()
    optimizer = optimizer if optimizer is not None else make_optimizer(model, kind)
    tokens, targets = batch()
    scales, skipped = [], []
    for step in range(steps):
        loss = loss_of(model, tokens, targets)
        if step in poison:
            loss = loss * float("inf")
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = applied_steps(optimizer)
        scaler.step(optimizer)
        scaler.update()
        skipped.append(applied_steps(optimizer) == before)
        scales.append(scaler.get_scale())
    return {
        "scales": scales,
        "skipped": skipped,
        "params": [p.detach().clone() for p in model.parameters()],
        "model": model,
        "optimizer": optimizer,
    }


def same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
