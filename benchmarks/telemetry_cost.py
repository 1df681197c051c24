"""What `GradScaler(telemetry=True)` and `watch` cost on a CPU: ratios in alternating rounds.

Usage: `python benchmarks/telemetry_cost.py [ROUNDS] [STEPS]` (default 8 rounds of 20 steps).

One small transformer in float32 (a 4,096-token embedding, four
`torch.nn.TransformerEncoderLayer(256, 4, 1024)` and a 4,096-way head:
5,253,120 parameters in 53 tensors) trained with
`torch.optim.AdamW(fused=True)` under `lossscale.torch.GradScaler`. Rows:

- `step`: `scaler.step(optimizer)` + `scaler.update()` on gradients restored
  before each step (untimed), without telemetry: the baseline;
- `step telemetry`: the same with `telemetry=True` (each parameter's
  finite flag, the counters, the overflow window);
- `train`: a whole step (forward, backward, step, update) with telemetry;
- `train watch`: the same with `lossscale.torch.watch(model, scaler)`.

Each round builds every row afresh and times each for STEPS steps after a
warm-up, in one order in even rounds and the reverse in odd ones (the
machine's speed drifts). Printed: each row's median ms over the rounds and
the median over the rounds of the per-round ratios (`step telemetry` to
`step`, `train watch` to `train`), and every round's ratios.
"""

import statistics
import sys
import time

import torch

import lossscale.torch

VOCAB, WIDTH, LAYERS, TOKENS = 4096, 256, 4, 256


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, batch_first=True)
            for _ in range(LAYERS)
        )
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(row):
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    telemetry = row != "step"
    scaler = lossscale.torch.GradScaler("cpu", init_scale=2.0**10, telemetry=telemetry)
    if row == "train watch":
        lossscale.torch.watch(model, scaler)
    tokens = torch.randint(0, VOCAB, (2, TOKENS // 2))

    def train():
        optimizer.zero_grad()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    if row.startswith("train"):
        return None, train
    train()  # gradients to restore before each timed step
    saved = [p.grad.clone() for p in model.parameters()]

    def prepare():
        for p, g in zip(model.parameters(), saved):
            p.grad.copy_(g)

    def step():
        scaler.step(optimizer)
        scaler.update()

    return prepare, step


def timed(row, steps):
    prepare, step = build(row)
    times = []
    for k in range(3 + steps):
        if prepare is not None:
            prepare()
        start = time.perf_counter()
        step()
        if k >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


ROWS = ("step", "step telemetry", "train", "train watch")
PAIRS = (("step telemetry", "step"), ("train watch", "train"))


def main(argv):
    rounds = int(argv[0]) if argv else 8
    steps = int(argv[1]) if len(argv) > 1 else 20
    torch.set_num_threads(2)
    parameters = sum(p.numel() for p in Model().parameters())
    print(f"torch {torch.__version__}, {parameters:,} parameters, {rounds} rounds of {steps}")
    results = {row: [] for row in ROWS}
    for r in range(rounds):
        for row in ROWS if r % 2 == 0 else reversed(ROWS):
            results[row].append(timed(row, steps))
        ratios = ", ".join(f"{a} / {b} {results[a][-1] / results[b][-1]:.3f}" for a, b in PAIRS)
        print(f"round {r}: {ratios}", flush=True)
    print("\n| row | median ms | ratio (median of rounds) |\n|---|---:|---:|")
    for row in ROWS:
        pair = next((b for a, b in PAIRS if a == row), None)
        ratio = ""
        if pair is not None:
            ratio = f"{statistics.median(x / y for x, y in zip(results[row], results[pair])):.3f}"
        print(f"| {row} | {statistics.median(results[row]):.2f} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1:])
