"""`lossscale bench` of an older commit against this checkout, in alternating rounds.

Usage: `python benchmarks/before_after.py OLD_COMMIT [ROUNDS] [WORKLOAD ...]
[--impl NAME ...]` (default 5 rounds of `tiny`, `many_small` and `large`).
OLD_COMMIT is checked out into a temporary git worktree; each round runs,
per workload, one `lossscale bench` process of each tree (by default
`lossscale-torch`, `lossscale-jax`, `lossscale-numpy`:
`LossScaleOptimizer(Adam)` on each backend; `--impl` names others, e.g.
`lossscale-torch-compiled`), the older first in odd rounds and this
checkout first in even ones, so that a drift of the machine's speed falls
on both alike. Every round's median ms per step is printed, then a table
of the medians of the rounds and their ratio (this checkout / older).
"""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMPLS = ("lossscale-torch", "lossscale-jax", "lossscale-numpy")


def _bench(src, workload, impls):
    """`{impl: median ms}` of one `lossscale bench` process run on the package in `src`."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    args = [sys.executable, "-m", "lossscale", "bench", "--workload", workload, "--rounds", "1"]
    for impl in impls:
        args += ["--impl", impl]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    times = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and cells[0] in impls:
            times[cells[0]] = float(cells[2].strip("*"))
    return times


def main(argv):
    impls = tuple(argv[i + 1] for i, a in enumerate(argv) if a == "--impl") or IMPLS
    argv = [a for i, a in enumerate(argv) if a != "--impl" and (i == 0 or argv[i - 1] != "--impl")]
    old, rounds = argv[0], int(argv[1]) if len(argv) > 1 else 5
    workloads = argv[2:] or ["tiny", "many_small", "large"]
    results = {}  # (workload, tree, impl) -> [ms per round]
    with tempfile.TemporaryDirectory() as scratch:
        tree = pathlib.Path(scratch) / "old"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), old],
            check=True,
            capture_output=True,
        )
        try:
            trees = {"old": tree / "src", "new": ROOT / "src"}
            for r in range(rounds):
                for workload in workloads:
                    order = ("old", "new") if r % 2 == 0 else ("new", "old")
                    for name in order:
                        for impl, ms in _bench(trees[name], workload, impls).items():
                            results.setdefault((workload, name, impl), []).append(ms)
                print(
                    json.dumps({"round": r + 1, **{"/".join(k): v[-1] for k, v in results.items()}})
                )
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    print(f"\n| workload | implementation | {old[:7]} (ms) | this checkout (ms) | ratio |")
    print("|---|---|---:|---:|---:|")
    for workload in workloads:
        for impl in impls:
            before = results.get((workload, "old", impl))
            after = results.get((workload, "new", impl))
            if not before or not after:
                continue
            b, a = statistics.median(before), statistics.median(after)
            print(f"| {workload} | {impl} | {b:.3f} | {a:.3f} | {a / b:.2f}x |")
            print(
                f"|  | rounds | {' / '.join(f'{x:.3f}' for x in before)} | "
                f"{' / '.join(f'{x:.3f}' for x in after)} | |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
