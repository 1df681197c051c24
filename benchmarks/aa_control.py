"""Rows of `lossscale bench` beside a second copy of their baseline: how much of a ratio is noise.

Usage: `python benchmarks/aa_control.py [WORKLOAD] [ROUNDS] [STEPS] [IMPL ...]`
(default `gpt`, 10 rounds of 200 steps, issue 29's AdamW rows). IMPL names
`lossscale bench` implementations (`lossscale bench --help` lists them); the
first is the baseline, and is built a second time as the row `<baseline>
again`, an A/A control: its ratio to the baseline is what this machine's
drift alone gives. Issue 33's diagnostics, for example:
`python benchmarks/aa_control.py tiny 10 5 diagnostics-off-torch diagnostics-on-torch`
(a step of those rows is a window of 100 optimizer steps).

The default rows:

- `torch-gradscaler-adamw-fused`: `torch.amp.GradScaler` +
  `torch.optim.AdamW(fused=True)`, the baseline;
- `lossscale-gradscaler-adamw-fused`: `lossscale.torch.GradScaler` + the
  same fused AdamW;
- `lossscale-torch-optimizer-adamw`: `torch.amp.GradScaler` +
  `lossscale.torch.Optimizer(AdamW)`.

Each round builds every row afresh (new buffers: where a row's tensors lie
in memory moves its time by a few percent), warms it up (3 steps and at
least 0.3 s), then times it for
STEPS steps (each row's untimed `prepare` before each step) and takes the
median; the rows run in one order in even rounds and the reverse in odd
ones. Printed: a table of the median ms, the median of the per-round
ratios to the baseline, and each round's ratio.
"""

import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

DEFAULT_ROWS = (
    "torch-gradscaler-adamw-fused",
    "lossscale-gradscaler-adamw-fused",
    "lossscale-torch-optimizer-adamw",
)


def main(argv):
    from lossscale.bench import registry, workloads

    workload = workloads.get(argv[0] if argv else "gpt")
    rounds = int(argv[1]) if len(argv) > 1 else 10
    steps = int(argv[2]) if len(argv) > 2 else 200
    impls = registry.load()
    requested = tuple(argv[3:]) or DEFAULT_ROWS
    unknown = [name for name in requested if name not in impls]
    if unknown:
        raise SystemExit(f"Unknown implementations: {unknown}. Known: {sorted(impls)}.")
    if any("torch" in impls[name].requires for name in requested):
        import torch

        torch.set_num_threads(2)
    baseline = requested[0]
    builders = {baseline: impls[baseline].setup, f"{baseline} again": impls[baseline].setup}
    builders.update({name: impls[name].setup for name in requested[1:]})
    medians = {name: [] for name in builders}
    names = list(builders)
    for r in range(rounds):
        # Built afresh each round: where a row's tensors land in memory moves
        # its time by a few percent, as the A/A row shows; fresh buffers each
        # round spread that over the rounds instead of fixing it per row.
        rows = {name: builders[name](workload) for name in names}
        for stepper in rows.values():  # warm-up: 3 steps and at least 0.3 s
            spent = sum(_timed(stepper) for _ in range(3))
            while spent < 0.3:
                spent += _timed(stepper)
        for name in names if r % 2 == 0 else names[::-1]:
            times = [_timed(rows[name]) for _ in range(steps)]
            medians[name].append(statistics.median(times) * 1e3)
        del rows
    print(f"# {workload.name}: {rounds} rounds of {steps} steps, ms per step\n")
    print(f"| row | median ms | median ratio to `{baseline}` | ratio per round |")
    print("|---|---:|---:|---|")
    for name, values in medians.items():
        ratios = [a / b for a, b in zip(values, medians[baseline])]
        print(
            f"| {name} | {statistics.median(values):.3f} | {statistics.median(ratios):.3f} | "
            + " / ".join(f"{x:.3f}" for x in ratios)
            + " |"
        )


def _timed(stepper):
    """Seconds of one step of `stepper` (its `prepare` untimed), waited for."""
    if stepper.prepare is not None:
        stepper.prepare()
    start = time.perf_counter()
    stepper.sync(stepper.step())
    return time.perf_counter() - start


if __name__ == "__main__":
    main(sys.argv[1:])
