"""Issue 29's AdamW rows beside a second copy of the baseline: how much of a ratio is noise.

Usage: `python benchmarks/aa_control.py [WORKLOAD] [ROUNDS] [STEPS]` (default
`gpt`, 10 rounds of 200 steps). Rows, built in one process from the
`lossscale bench` implementations:

- `torch`: `torch.amp.GradScaler` + `torch.optim.AdamW(fused=True)`, the baseline;
- `torch again`: the same, built a second time (an A/A control: its ratio
  to `torch` is what this machine's drift alone gives);
- `our GradScaler`: `lossscale.torch.GradScaler` + the same fused AdamW;
- `our Optimizer`: `torch.amp.GradScaler` + `lossscale.torch.Optimizer(AdamW)`.

Each round builds every row afresh (new buffers: where a row's tensors lie
in memory moves its time by a few percent), warms it up, then times it for
STEPS steps (the gradients restored before each step, untimed) and takes
the median; the rows run in one order in even rounds and the reverse in
odd ones. Printed: each round's ratio to `torch`,
then a table of the median ms and the median of the per-round ratios.
"""

import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))


def main(argv):
    import torch

    from lossscale.bench import impl_lossscale, impl_torch, workloads

    workload = workloads.get(argv[0] if argv else "gpt")
    rounds = int(argv[1]) if len(argv) > 1 else 10
    steps = int(argv[2]) if len(argv) > 2 else 200
    torch.set_num_threads(2)
    builders = {
        "torch": impl_torch.grad_scaler_adamw_fused,
        "torch again": impl_torch.grad_scaler_adamw_fused,
        "our GradScaler": impl_torch.lossscale_grad_scaler_adamw_fused,
        "our Optimizer": impl_lossscale.torch_optimizer_adamw,
    }
    medians = {name: [] for name in builders}
    names = list(builders)
    for r in range(rounds):
        # Built afresh each round: where a row's tensors land in memory moves
        # its time by a few percent, as the A/A row shows; fresh buffers each
        # round spread that over the rounds instead of fixing it per row.
        rows = {name: builders[name](workload) for name in names}
        for stepper in rows.values():  # warm-up
            for _ in range(20):
                stepper.prepare()
                stepper.step()
        for name in names if r % 2 == 0 else names[::-1]:
            stepper, times = rows[name], []
            for _ in range(steps):
                stepper.prepare()
                start = time.perf_counter()
                stepper.step()
                times.append(time.perf_counter() - start)
            medians[name].append(statistics.median(times) * 1e3)
        del rows
    print(f"# {workload.name}: {rounds} rounds of {steps} steps, ms per step\n")
    print("| row | median ms | median ratio to `torch` | ratio per round |")
    print("|---|---:|---:|---|")
    for name, values in medians.items():
        ratios = [a / b for a, b in zip(values, medians["torch"])]
        print(
            f"| {name} | {statistics.median(values):.3f} | {statistics.median(ratios):.3f} | "
            + " / ".join(f"{x:.3f}" for x in ratios)
            + " |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
